"""Autograd plumbing for the backward hooks.

``RegisterFSDPBackwardFunction`` wraps a unit's inputs in forward; its backward runs
once the gradients for those inputs are computed, that is after the unit's own
backward, and calls the unit's post-backward. ``register_pre_backward`` fires a
callback when the first gradient reaches any of a module's outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = [
    "RegisterFSDPBackwardFunction",
    "in_backward",
    "queue_end_of_backward_callback",
    "register_pre_backward",
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


def in_backward() -> bool:
    """True while the autograd engine is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def wrap_inputs_for_post_backward(
    post_backward: Callable[[], None], args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    """Route every input tensor that requires grad through the backward function."""
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not positions:
        return args, kwargs
    outs = RegisterFSDPBackwardFunction.apply(post_backward, *(flat[i] for i in positions))
    if len(positions) == 1:
        outs = (outs,)
    for i, out in zip(positions, outs, strict=True):
        flat[i] = out
    new_args, new_kwargs = tree_unflatten(flat, spec)
    return new_args, new_kwargs


def register_pre_backward(output: Any, callback: Callable[[], None]) -> bool:
    """Call ``callback`` once, when the first gradient reaches any output tensor that
    requires grad. Returns False when no output requires grad (nothing registered)."""
    flat, _ = tree_flatten(output)
    tensors = [x for x in flat if isinstance(x, torch.Tensor) and x.requires_grad]
    if not tensors:
        return False
    register_multi_grad_hook(tensors, lambda _grads: callback(), mode="any")
    return True


def queue_end_of_backward_callback(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)
