"""Activations of one forward, from a meta-device run: the tensors saved for backward.

The module (a meta-device copy) runs forward on meta inputs under
``fsdp_hooks.diagnostics.activations.SavedTensorCounter``, the accounting ``measure_activations()``
applies to the real forward: each saved storage once, parameters and buffers not.
Nothing is allocated and no kernel runs.

One substitution: ``scaled_dot_product_attention`` on the meta device would dispatch to
the math path, which saves the ``batch x heads x seq x seq`` attention probabilities;
the fused kernels a job runs (flash or memory-efficient on CUDA, flash on CPU) save
the inputs, the output and a float32 log-sum-exp per query instead. So on meta the
call is replaced by an output of the right shape and those saved tensors are counted.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from fsdp_hooks.diagnostics.activations import SavedTensorCounter

__all__ = ["forward_inputs", "meta_activations"]


class _FusedAttention(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` on meta tensors as a fused kernel: an output
    of the right shape; ``q``, ``k``, ``v``, the mask, the output and the log-sum-exp
    counted as saved."""

    def __init__(self, counter: SavedTensorCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask")
        q, k, v, mask = (*args, *(kwargs.get(n) for n in names[len(args) :]))[:4]
        if q.device.type != "meta":
            return func(*args, **kwargs)
        out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            out.requires_grad_(True)
            self.counter.add(q, k, v, mask, out, lse)
        return out


def forward_inputs(
    batch_size: int | None, seq_len: int | None, example_inputs: Any
) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` of the forward to plan, on the meta device: ``example_inputs``
    (a tensor, a tuple of positional arguments, or a dict of keyword arguments; real
    tensors are replaced by meta ones of the same shape and dtype), or token ids of shape
    ``(batch_size, seq_len)``; None when neither is given."""
    if example_inputs is not None:
        if batch_size is not None or seq_len is not None:
            raise ValueError(
                "give either example_inputs or batch_size and seq_len (token ids), not both"
            )
        to_meta = lambda t: torch.empty_like(t, device="meta")  # noqa: E731
        if isinstance(example_inputs, torch.Tensor):
            return (to_meta(example_inputs),), {}
        if isinstance(example_inputs, dict):
            return (), tree_map_only(torch.Tensor, to_meta, dict(example_inputs))
        if isinstance(example_inputs, (tuple, list)):
            return tree_map_only(torch.Tensor, to_meta, tuple(example_inputs)), {}
        raise TypeError(
            "example_inputs must be a tensor, a tuple of positional arguments or a dict of "
            f"keyword arguments; got {type(example_inputs).__name__}"
        )
    if batch_size is None and seq_len is None:
        return None
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{name} must be a positive int (both batch_size and seq_len are needed for "
                f"token ids); got {value!r}"
            )
    assert batch_size is not None and seq_len is not None
    return (torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta"),), {}


def meta_activations(module: nn.Module, args: tuple, kwargs: dict) -> int:
    """Bytes of the tensors ``module``'s training forward saves for backward, from a
    run on the meta device (``module``'s parameters must be meta)."""
    persistent = [*module.parameters(), *module.buffers()]
    was_training = module.training
    module.train()
    try:
        counter = SavedTensorCounter(persistent)
        with counter, _FusedAttention(counter), torch.enable_grad():
            module(*args, **kwargs)
    except Exception as err:
        raise RuntimeError(
            f"plan(): the meta-device forward for activations failed ({type(err).__name__}: "
            f"{err}); the model's forward must run on meta tensors (no .item(), no data-"
            "dependent shapes, no collectives). Leave out batch_size/seq_len/example_inputs "
            "to plan model state and communication only"
        ) from err
    finally:
        module.train(was_training)
    return counter.nbytes
