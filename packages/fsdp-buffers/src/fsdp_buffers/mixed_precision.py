"""The mixed-precision policy: which dtype each copy of a parameter's state is kept in.

A parameter has up to three dtypes besides the one the model computes in: its main
weights (what the optimizer steps), its main gradients (where microbatch gradients
accumulate) and its gradient communication (what the reduce-scatter / all-reduce
sends). The policy holds the user's choices; the ``*_for`` methods resolve them for one
parameter dtype, so every buffer asks the same question the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

__all__ = ["MixedPrecisionPolicy", "cast_floating"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Mixed-precision configuration; field names and order are Megatron-FSDP's.

    Args:
        main_params_dtype: dtype of the main weights the optimizer steps. ``None`` keeps
            the main weights in the parameter's own dtype. Default ``torch.float32``.
        main_grads_dtype: dtype gradients accumulate in across microbatches. ``None``
            applies the rule below. Default ``None``.
        grad_comm_dtype: dtype gradients are communicated in. ``None`` communicates in the
            main-gradient dtype. Default ``None``.

    **The main-gradient rule (differs from Megatron-FSDP on purpose).** When
    ``main_grads_dtype`` is ``None``, gradients of parameters narrower than 32 bits
    (bf16, fp16, fp8) accumulate in ``torch.float32``; gradients of fp32 and fp64
    parameters accumulate in their own dtype. Megatron-FSDP instead accumulates in the
    parameter's dtype, and bf16 accumulation over many microbatches loses precision:
    bf16 keeps 8 significant bits, so once the running sum is 2^8 times larger than one
    microbatch's contribution, that contribution is rounded away (each add is exact only
    to a relative step of 2^-8). Pass ``main_grads_dtype=torch.bfloat16`` to get
    Megatron-FSDP's behaviour (and its memory saving) back.

    Every dtype given must be a floating dtype; main weights and main gradients must be
    at least 16 bits wide, since fp8 can neither hold optimizer updates nor accumulate.
    The policy covers floating-point parameters only: integer or boolean tensors
    registered as parameters are not trained and have no main weights or gradients, and
    asking the policy about them raises ``ValueError``.

    Main weights are never narrower than the parameter: with the default
    ``main_params_dtype=torch.float32`` an fp64 parameter keeps fp64 main weights.

    The three dtypes combine freely. Where the main grads' dtype differs from the main
    weights' (fp32 weights with bf16 grads, as Megatron-Core's ``--grad-reduce-in-bf16``;
    ``main_params_dtype=None`` on a bf16 model; fp64 weights with fp32 grads), the
    optimizer's ``.grad`` is the reduced main gradient cast to the main weights' dtype
    (as Megatron-FSDP's ``update_main_grads``): one extra copy of the gradient shard.

    **PyTorch FSDP2's spelling** (``torch.distributed.fsdp.MixedPrecisionPolicy``) is
    accepted beside these fields, by keyword:

    - ``param_dtype``: the dtype the model computes in (the compute weights, the
      model-weight buffer). The library makes the compute copy: an fp32 model wrapped
      with ``param_dtype=torch.bfloat16`` computes in bf16 (the parameters the forward
      sees are bf16 views of the gathered bucket) while the main weights stay in
      ``main_params_dtype_for`` of the model's own dtype (fp32: loaded from the
      original fp32 values, not from their bf16 rounding); gradients accumulate in
      ``main_grads_dtype_for`` of the model's dtype (fp32 by default) and the state
      dict holds the main weights. Frozen floating parameters in another dtype than
      ``param_dtype`` are refused at wrap (they have no main weights to keep their
      own precision in).
    - ``reduce_dtype``: FSDP2's name for ``grad_comm_dtype`` (give one, or both equal).
      When neither is given gradients are reduced in the main-grad dtype (fp32 by
      default), where FSDP2 reduces in ``param_dtype``: pass
      ``reduce_dtype=param_dtype`` for FSDP2's cheaper reduction.
    - ``output_dtype``: floating outputs of the wrapper's forward are cast to it.
    - ``cast_forward_inputs``: floating inputs of the wrapper's forward are cast to
      ``param_dtype`` (when it is set). Default ``True``, as FSDP2.
    """

    main_params_dtype: torch.dtype | None = torch.float32
    main_grads_dtype: torch.dtype | None = None
    grad_comm_dtype: torch.dtype | None = None
    # PyTorch FSDP2's fields (keyword use; see the class docstring).
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                f"MixedPrecisionPolicy.cast_forward_inputs must be a bool, got "
                f"{self.cast_forward_inputs!r}"
            )
        if (
            self.reduce_dtype is not None
            and self.grad_comm_dtype is not None
            and self.reduce_dtype != self.grad_comm_dtype
        ):
            raise ValueError(
                f"MixedPrecisionPolicy: reduce_dtype={self.reduce_dtype} (FSDP2's name) and "
                f"grad_comm_dtype={self.grad_comm_dtype} (Megatron-FSDP's) name the same "
                f"thing, the dtype gradients are reduced in; give one of them"
            )
        for f in fields(self):
            if f.name == "cast_forward_inputs":
                continue
            dtype = getattr(self, f.name)
            if dtype is None:
                continue
            if not isinstance(dtype, torch.dtype):
                raise TypeError(
                    f"MixedPrecisionPolicy.{f.name} must be a torch.dtype or None, got "
                    f"{dtype!r} of type {type(dtype).__name__}; e.g. torch.float32 or "
                    "torch.bfloat16."
                )
            if not dtype.is_floating_point:
                raise ValueError(
                    f"MixedPrecisionPolicy.{f.name} must be a floating-point dtype, got "
                    f"{dtype}; use e.g. torch.float32, torch.bfloat16 or torch.float16, "
                    "or None."
                )
            if f.name in ("main_params_dtype", "main_grads_dtype") and dtype.itemsize < 2:
                raise ValueError(
                    f"MixedPrecisionPolicy.{f.name}={dtype} is too narrow: main weights and "
                    "main gradients need at least 16 bits (fp8 cannot hold optimizer "
                    "updates or accumulate gradients); use torch.float32, torch.bfloat16, "
                    "torch.float16 or None."
                )

    def compute_dtype_for(self, param_dtype: torch.dtype) -> torch.dtype:
        """dtype of the compute weights (the model-weight buffer) of a ``param_dtype``
        parameter: ``param_dtype`` (the field) when set, else the parameter's own."""
        _check_param_dtype(param_dtype)
        return self.param_dtype if self.param_dtype is not None else param_dtype

    def main_params_dtype_for(self, param_dtype: torch.dtype) -> torch.dtype:
        """dtype of the main weights for a parameter of ``param_dtype``."""
        _check_param_dtype(param_dtype)
        main = self.main_params_dtype
        # Never narrower than the parameter: an fp64 model keeps fp64 main weights.
        if main is None or main.itemsize < param_dtype.itemsize:
            return param_dtype
        return main

    def main_grads_dtype_for(self, param_dtype: torch.dtype) -> torch.dtype:
        """dtype gradients of a ``param_dtype`` parameter accumulate in (see the class rule)."""
        _check_param_dtype(param_dtype)
        if self.main_grads_dtype is not None:
            return self.main_grads_dtype
        # Narrow floats accumulate in fp32: a bf16 running sum drops small contributions.
        return torch.float32 if param_dtype.itemsize < 4 else param_dtype

    def grad_comm_dtype_for(self, param_dtype: torch.dtype) -> torch.dtype:
        """dtype gradients of a ``param_dtype`` parameter are reduced in."""
        comm = self.grad_comm_dtype if self.grad_comm_dtype is not None else self.reduce_dtype
        if comm is not None:
            _check_param_dtype(param_dtype)
            return comm
        return self.main_grads_dtype_for(param_dtype)


def _check_param_dtype(param_dtype: torch.dtype) -> None:
    if not isinstance(param_dtype, torch.dtype):
        raise TypeError(
            f"Expected a parameter's torch.dtype, got {param_dtype!r} of type "
            f"{type(param_dtype).__name__}; pass e.g. param.dtype."
        )
    if not param_dtype.is_floating_point:
        raise ValueError(
            f"MixedPrecisionPolicy applies to floating-point parameters only, got {param_dtype}. "
            "Integer, boolean and complex tensors have no main weights or gradients; keep "
            "them out of the sharded parameters (register them as buffers, or set "
            "requires_grad=False and exclude them)."
        )


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with its floating tensors cast to ``dtype`` (FSDP2's input/output casts)."""
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)
