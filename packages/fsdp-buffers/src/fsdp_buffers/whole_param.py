"""The user-visible parameter (and gradient) of a whole-placed slot (Note [whole placement]
in ``layout``).

One rank, the owner, holds such a parameter whole; no DTensor placement describes that
without a cost we measured and refused (docs/design.md, "Whole placement"): a ``Partial``
sum with zeros elsewhere needs every rank to hold the whole matrix (or a stride-0 zero that
in-place ops refuse on the non-owners only), and a ``Replicate`` on the owner's one-rank
sub-mesh makes ``full_tensor()`` return an empty tensor on the other ranks. A plain tensor
(the whole matrix on the owner, nothing elsewhere) made torch's ``clip_grad_norm_`` compute a
local norm on each rank: silently wrong.

So ``model.parameters()``, the optimizer's param groups outside fsdp's own calls, and their
``.grad`` hold a ``WholeParameter`` / ``WholeGrad`` on *every* rank: metadata only (global
shape, dtype, the buffer's device, ``requires_grad``, ``.grad``), no data. Any tensor
operation on them raises the same ``RuntimeError`` on every rank before any communication
(torch's ``clip_grad_norm_``, ``full_tensor()``, ``mean()``, in-place writes, ``.data``,
``torch.save``), naming what to use instead. fsdp's own code reaches the real tensor (on
the owner) through ``_fsdp_inner``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["WholeGrad", "WholeParameter", "inner_of", "is_whole_parameter"]

_MESSAGE = (
    "{what} {name} of shape {shape} is placed whole on rank {owner} of its shard group (for "
    "a whole-matrix optimizer such as Muon), so no torch tensor here holds its value and "
    "{func} cannot be computed on it; use the fsdp model's own tools: "
    "model.clip_grad_norm_(max_norm) for the gradient norm, "
    "model.buffer.views.full_parameter(name) for the value (a collective), "
    "model.state_dict() / fsdp_ckpt for checkpoints"
)


def _metadata_getters() -> frozenset[Any]:
    t = torch.Tensor
    return frozenset(
        {
            t.shape.__get__,  # type: ignore[attr-defined]
            t.dtype.__get__,  # type: ignore[attr-defined]
            t.ndim.__get__,  # type: ignore[attr-defined]
            t.requires_grad.__get__,  # type: ignore[attr-defined]
            t.requires_grad.__set__,  # type: ignore[attr-defined]
            t.grad.__get__,  # type: ignore[attr-defined]
            t.grad.__set__,  # type: ignore[attr-defined]
            t.is_leaf.__get__,  # type: ignore[attr-defined]
            t.grad_fn.__get__,  # type: ignore[attr-defined]
            t.layout.__get__,  # type: ignore[attr-defined]
            t.is_sparse.__get__,  # type: ignore[attr-defined]
            t.size,
            t.dim,
            t.numel,
            t.nelement,
            t.element_size,
            t.requires_grad_,
            t.is_floating_point,
            t.is_complex,
            t.__hash__,
        }
    )


_ALLOWED: frozenset[Any] = _metadata_getters()


def _torch_function(cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    kwargs = kwargs or {}
    if func == torch.Tensor.device.__get__:  # type: ignore[attr-defined]
        return args[0]._fsdp_device
    if func in _ALLOWED:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    # Refused: find the guard to name it (only on this error path).
    guard = next((a for a in args if isinstance(a, (WholeParameter, WholeGrad))), None)
    if guard is None:  # inside a list: torch._foreach_norm([...]), torch.stack([...])
        for a in args:
            if isinstance(a, (list, tuple)):
                guard = next((x for x in a if isinstance(x, (WholeParameter, WholeGrad))), None)
                if guard is not None:
                    break
    what = "the gradient of parameter" if isinstance(guard, WholeGrad) else "parameter"
    raise RuntimeError(
        _MESSAGE.format(
            what=what,
            name=getattr(guard, "_fsdp_name", "?"),
            shape=tuple(guard.shape) if guard is not None else "?",
            owner=getattr(guard, "_fsdp_whole_owner", "?"),
            func=_name_of(func),
        )
    )


def _name_of(func: Any) -> str:
    owner = getattr(func, "__self__", None)  # a property's getter: name the property
    name = getattr(owner, "__name__", None) if func.__name__ in ("__get__", "__set__") else None
    return name or getattr(func, "__name__", repr(func))


def _new(cls: type, shape: torch.Size, dtype: torch.dtype, requires_grad: bool) -> Any:
    data = torch.empty(shape, dtype=dtype, device="meta")
    return torch.Tensor._make_subclass(cls, data, requires_grad)


class WholeGrad(torch.Tensor):
    """The ``.grad`` of a ``WholeParameter`` (module note), alike on every rank."""

    __torch_function__ = classmethod(_torch_function)  # type: ignore[assignment]

    def __new__(cls, param: WholeParameter) -> WholeGrad:
        grad = _new(cls, param.shape, param.dtype, False)
        grad._fsdp_device = param._fsdp_device  # type: ignore[attr-defined]
        grad._fsdp_name = param._fsdp_name  # type: ignore[attr-defined]
        grad._fsdp_whole_owner = param._fsdp_whole_owner  # type: ignore[attr-defined]
        return grad

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return f"WholeGrad(of {self._fsdp_name}, shape={tuple(self.shape)})"  # type: ignore[attr-defined]


class WholeParameter(nn.Parameter):
    """A whole-placed parameter as the model and the optimizer show it (module note).
    ``_fsdp_inner`` is the tensor fsdp steps: the whole main weight on the owner, a meta
    placeholder elsewhere."""

    __torch_function__ = classmethod(_torch_function)  # type: ignore[assignment]

    def __new__(
        cls, name: str, inner: nn.Parameter, owner: int, device: torch.device
    ) -> WholeParameter:
        param = _new(cls, inner.shape, inner.dtype, True)
        param._fsdp_name = name  # type: ignore[attr-defined]
        param._fsdp_inner = inner  # type: ignore[attr-defined]
        param._fsdp_whole_owner = owner  # type: ignore[attr-defined]
        param._fsdp_device = device  # type: ignore[attr-defined]
        param._fsdp_grad = WholeGrad(param)  # type: ignore[attr-defined]
        return param

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return (
            f"WholeParameter({self._fsdp_name}, shape={tuple(self.shape)}, "  # type: ignore[attr-defined]
            f"owner={self._fsdp_whole_owner})"  # type: ignore[attr-defined]
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        # nn.Parameter pickles without __torch_function__: refuse as every operation does.
        return _torch_function(type(self), torch.Tensor.__reduce_ex__, (), (self, protocol))

    def __deepcopy__(self, memo: Any) -> Any:
        return _torch_function(type(self), torch.Tensor.__deepcopy__, (), (self, memo))

    # DTensor's methods, for code written for FSDP2's parameters: the same clear error.
    def full_tensor(self, *args: Any, **kwargs: Any) -> Any:
        return _torch_function(type(self), WholeParameter.full_tensor, (), (self,))

    def to_local(self, *args: Any, **kwargs: Any) -> Any:
        return _torch_function(type(self), WholeParameter.to_local, (), (self,))

    def redistribute(self, *args: Any, **kwargs: Any) -> Any:
        return _torch_function(type(self), WholeParameter.redistribute, (), (self,))


def is_whole_parameter(p: object) -> bool:
    return isinstance(p, WholeParameter)


def inner_of(p: torch.Tensor) -> torch.Tensor:
    """The tensor fsdp steps for ``p``: its ``_fsdp_inner`` for a ``WholeParameter``."""
    return p._fsdp_inner if isinstance(p, WholeParameter) else p  # type: ignore[attr-defined]
