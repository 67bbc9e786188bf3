"""Autograd plumbing for the backward hooks.

``RegisterFSDPBackwardFunction`` wraps a unit's inputs in forward; its backward runs
once the gradients for those inputs are computed, that is after the unit's own
backward, and calls the unit's post-backward. ``register_pre_backward`` fires a
callback when the first gradient reaches any of a module's outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = [
    "RegisterFSDPBackwardFunction",
    "flatten_tensors",
    "in_backward",
    "map_tensors",
    "queue_end_of_backward_callback",
    "register_pre_backward",
    "storage_key",
    "wrap_inputs_for_post_backward",
]


class RegisterFSDPBackwardFunction(torch.autograd.Function):
    """Identity on its tensor inputs; calls ``post_backward()`` in backward."""

    @staticmethod
    def forward(ctx, post_backward: Callable[[], None], *inputs: torch.Tensor):  # type: ignore[override]
        ctx.post_backward = post_backward
        return inputs if len(inputs) != 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.post_backward()
        return (None, *grads)


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """The identity of ``t``'s storage: stable across ``resize_`` (a released and
    re-gathered bucket keeps its storage object), distinct for distinct storages (meta
    tensors included, whose data pointers are all 0)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.device.type, t.untyped_storage()._cdata


def in_backward() -> bool:
    """True while the autograd engine is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def flatten_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj``: a pytree (tuples, lists, dicts, namedtuples, ...) whose
    plain ``@dataclass`` leaves are walked field by field, as units may return them."""
    out: list[torch.Tensor] = []
    for leaf in tree_flatten(obj)[0]:
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif _is_dataclass_instance(leaf):
            for f in dataclasses.fields(leaf):
                out.extend(flatten_tensors(getattr(leaf, f.name)))
    return out


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with each tensor ``t`` (dataclass fields included) replaced by ``fn(t)``."""
    flat, spec = tree_flatten(obj)
    for i, leaf in enumerate(flat):
        if isinstance(leaf, torch.Tensor):
            flat[i] = fn(leaf)
        elif _is_dataclass_instance(leaf):
            changes = {
                f.name: map_tensors(getattr(leaf, f.name), fn)
                for f in dataclasses.fields(leaf)
                if f.init
            }
            flat[i] = dataclasses.replace(leaf, **changes)
    return tree_unflatten(flat, spec)


def _plain_tensors(args: tuple, kwargs: dict) -> bool:
    """Whether ``args`` holds only tensors and ``kwargs`` is empty (most units' calls):
    then the pytree of ``(args, kwargs)`` is ``args`` itself, walked without pytree."""
    return not kwargs and all(isinstance(x, torch.Tensor) for x in args)


def wrap_inputs_for_post_backward(
    post_backward: Callable[[], None], args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    """Route every input tensor that requires grad (dataclass fields included) through
    the backward function."""
    if len(args) == 1 and not kwargs and isinstance(x := args[0], torch.Tensor):
        # The usual unit call, one tensor: no pytree, no maps by id.
        if not x.requires_grad:
            return args, kwargs
        return (RegisterFSDPBackwardFunction.apply(post_backward, x),), kwargs
    plain = _plain_tensors(args, kwargs)
    leaves = args if plain else flatten_tensors((args, kwargs))
    unique = {id(x): x for x in leaves if x.requires_grad}
    tensors = list(unique.values())
    if not tensors:
        return args, kwargs
    outs = RegisterFSDPBackwardFunction.apply(post_backward, *tensors)
    if len(tensors) == 1:
        outs = (outs,)
    routed = {id(t): out for t, out in zip(tensors, outs, strict=True)}
    if plain:
        return tuple(routed.get(id(t), t) for t in args), {}
    return map_tensors((args, kwargs), lambda t: routed.get(id(t), t))


class _FirstGradHook:
    """The hook ``register_pre_backward`` puts on each output: calls ``callback`` at the
    first gradient of each backward (graph task) reaching any of them, as
    ``register_multi_grad_hook(mode="any")`` does, without its lock and closures (one
    per unit per step). Hooks of one graph task run on one thread."""

    __slots__ = ("_callback", "_ran")

    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback = callback
        self._ran: set[int] | None = None  # graph tasks it ran in; only with several outputs

    def __call__(self, _grad: torch.Tensor) -> None:
        if self._ran is not None:
            task = torch._C._current_graph_task_id()
            if task in self._ran:
                return
            self._ran.add(task)
        self._callback()


def register_pre_backward(output: Any, callback: Callable[[], None]) -> bool:
    """Call ``callback`` once, when the first gradient reaches any output tensor that
    requires grad (dataclass fields included). Returns False when no output requires
    grad (nothing registered)."""
    if isinstance(output, torch.Tensor):  # the usual unit output: no pytree walk
        tensors = [output] if output.requires_grad else []
    else:
        tensors = [x for x in flatten_tensors(output) if x.requires_grad]
    if not tensors:
        return False
    hook = _FirstGradHook(callback)
    if len(tensors) > 1:
        # A node runs once per graph task, so one output needs no record of tasks.
        hook._ran = set()
    for t in tensors:
        t.register_hook(hook)
    return True


def queue_end_of_backward_callback(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)
