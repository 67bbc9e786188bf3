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


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    flat, spec = tree_flatten(obj)
    for i, leaf in enumerate(flat):
        if isinstance(leaf, torch.Tensor):
            flat[i] = fn(leaf)
        elif _is_dataclass_instance(leaf):
            changes = {
                f.name: _map_tensors(getattr(leaf, f.name), fn)
                for f in dataclasses.fields(leaf)
                if f.init
            }
            flat[i] = dataclasses.replace(leaf, **changes)
    return tree_unflatten(flat, spec)


def wrap_inputs_for_post_backward(
    post_backward: Callable[[], None], args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    """Route every input tensor that requires grad (dataclass fields included) through
    the backward function."""
    unique = {id(x): x for x in flatten_tensors((args, kwargs)) if x.requires_grad}
    tensors = list(unique.values())
    if not tensors:
        return args, kwargs
    outs = RegisterFSDPBackwardFunction.apply(post_backward, *tensors)
    if len(tensors) == 1:
        outs = (outs,)
    routed = {id(t): out for t, out in zip(tensors, outs, strict=True)}
    return _map_tensors((args, kwargs), lambda t: routed.get(id(t), t))


def register_pre_backward(output: Any, callback: Callable[[], None]) -> bool:
    """Call ``callback`` once, when the first gradient reaches any output tensor that
    requires grad (dataclass fields included). Returns False when no output requires
    grad (nothing registered)."""
    tensors = [x for x in flatten_tensors(output) if x.requires_grad]
    if not tensors:
        return False
    register_multi_grad_hook(tensors, lambda _grads: callback(), mode="any")
    return True


def queue_end_of_backward_callback(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)
