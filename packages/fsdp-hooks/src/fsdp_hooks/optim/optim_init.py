"""Optimizer state before the first step, so that a fresh optimizer is a load target.

``fully_shard_optimizer`` creates the state of every trainable parameter as
Megatron-FSDP's does: one step of the optimizer's own class with zero gradients. Unlike
a plain zero-gradient step, learning rate and weight decay are zero during it, the
weights are restored after it bit for bit, and each ``step`` counter is reset to 0, so
Adam/AdamW/SGD-with-momentum state is exactly what their first step would start from
(zeros, step 0). ``optimizer.state_dict()`` then has every tensor that plain
``dcp.load`` fills in place, and ``optimizer.load_state_dict`` takes the result.

Some optimizers do not treat "zero state" like "no state" (SGD with ``dampening``
copies the first gradient into an absent momentum buffer but damps it into a present
one; NAdam keeps a running ``mu_product``). So the created state is remembered
(``InitialState``), and the first step that updates a parameter drops its state if it
is still the created one, untouched (same tensors, same versions: neither
``load_state_dict`` nor an in-place ``dcp.load`` has written it): that step then does
exactly what it does on a fresh optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

__all__ = ["InitialState", "init_optimizer_state"]

# Hyperparameters zeroed during the initialising step (weight decay would otherwise
# enter Adam's moments and SGD's momentum buffer through the gradient).
_ZEROED = ("lr", "weight_decay")


def _version(value: object) -> int | None:
    if isinstance(value, DTensor):
        return value._local_tensor._version
    if isinstance(value, torch.Tensor):
        return value._version
    return None


def _fingerprint(state: dict) -> tuple:
    return tuple((key, id(value), _version(value)) for key, value in state.items())


@dataclass
class InitialState:
    """The state ``init_optimizer_state`` created, per parameter: the state dict object
    and a fingerprint of its entries (key, object, version)."""

    created: dict[torch.Tensor, tuple[dict, tuple]] = field(default_factory=dict)

    def drop_untouched(self, optimizer: torch.optim.Optimizer) -> None:
        """Before a step: forget the created state of every parameter about to be
        updated (it has a gradient) whose state nobody has loaded or changed."""
        for p in [p for p in self.created if _has_grad(p)]:
            state, fingerprint = self.created.pop(p)
            current = optimizer.state.get(p)
            if current is state and _fingerprint(current) == fingerprint:
                del optimizer.state[p]


def _has_grad(p: torch.Tensor) -> bool:
    # A precision-aware optimizer reads .decoupled_grad (Megatron-FSDP's use_decoupled_grad).
    return p.grad is not None or getattr(p, "decoupled_grad", None) is not None


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            seen.setdefault(id(p), p)
    return list(seen.values())


def _zero_like(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    return type(value)(0)


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> InitialState:
    """Create the state of every trainable parameter of ``optimizer`` that has none (see
    the module note); gradients, hyperparameters and weights are left as they were."""
    params = _params(optimizer)
    # A meta parameter is a whole-placed one that another rank holds and steps.
    todo = [p for p in params if p.requires_grad and not p.is_meta and not optimizer.state.get(p)]
    if not todo:
        return InitialState()
    saved_grads = {p: p.grad for p in params}
    decoupled = {p: p.decoupled_grad for p in params if hasattr(p, "decoupled_grad")}
    saved_hparams = [{k: g[k] for k in _ZEROED if k in g} for g in optimizer.param_groups]
    saved_weights = [p.detach().clone() for p in todo]
    wanted = {id(p) for p in todo}
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if id(p) in wanted else None
            if p in decoupled:
                p.decoupled_grad = p.grad
        for group, hparams in zip(optimizer.param_groups, saved_hparams, strict=True):
            for key, value in hparams.items():
                group[key] = _zero_like(value)
        type(optimizer).step(optimizer)  # the class's own step, not a patched one
    finally:
        for group, hparams in zip(optimizer.param_groups, saved_hparams, strict=True):
            group.update(hparams)
        for p, weight in zip(todo, saved_weights, strict=True):
            p.copy_(weight)
        for p, grad in saved_grads.items():
            p.grad = grad
        for p, grad in decoupled.items():
            p.decoupled_grad = grad
    record = InitialState()
    for p in todo:
        state = optimizer.state.get(p)
        if not state:
            continue  # stateless (plain SGD): nothing to load either
        if "step" in state:
            state["step"] = _zero_like(state["step"])
        record.created[p] = (state, _fingerprint(state))
    return record
