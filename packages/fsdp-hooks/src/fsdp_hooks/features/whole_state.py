"""State dicts of whole-placed parameters (Note [whole placement] in
``fsdp_buffers.layout``) independent of the placement.

``model.state_dict()`` of a model with whole-placed parameters holds, for each, exactly
what the row placement gives: a ``Shard(0)`` DTensor of ``torch.chunk`` pieces on the
optimizer mesh. So a checkpoint saved under whole placement (fsdp_ckpt or plain DCP) loads
into a row-placed model or another world size, and back. The cost is paid at checkpoint
time only: one broadcast from the owner per whole parameter (``state_dict``), one
``full_tensor`` per whole parameter (``load_state_dict``); every rank of the shard group
must call them, as DCP and ``get_model_state_dict`` do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_buffers.dtensor_views import DTensorViews
from fsdp_buffers.whole_param import inner_of
from fsdp_hooks.runtime.hooks import FSDPHooks

__all__ = ["register_whole_optimizer_state", "row_placed_whole_params"]


@contextlib.contextmanager
def row_placed_whole_params(hooks: FSDPHooks, load: bool) -> Iterator[None]:
    """While the wrapped module's ``state_dict`` (or, with ``load``, ``load_state_dict``)
    runs, every place a ``WholeParameter`` is reachable from holds a parameter over its
    row-placement DTensor (module note); after a load, what is there then (loaded in
    place, or assigned) is written into the owner's main weights. Collectives, in the
    parameters' order, on every rank."""
    views = hooks.buffer.views
    names = views.whole_names()
    if not names:
        yield
        return
    distributed = dict(views.distributed_named_parameters())
    temps: dict[int, tuple[str, nn.Parameter]] = {}
    for name in names:
        guard = distributed[name]
        row = views.whole_row_dtensor(name, views.whole_full(name, None))
        temps[id(guard)] = (name, nn.Parameter(row, requires_grad=guard.requires_grad))
    swapped = [
        (module, attr, dparam)
        for module, attr, _compute, dparam in hooks.swap.locations
        if id(dparam) in temps
    ]
    for module, attr, dparam in swapped:
        module._parameters[attr] = temps[id(dparam)][1]
    try:
        yield
        if load:
            done: set[str] = set()
            for module, attr, dparam in swapped:
                name = temps[id(dparam)][0]
                if name in done:
                    continue  # tied: one place is enough
                done.add(name)
                value = module._parameters[attr]
                assert value is not None
                full = value.full_tensor() if isinstance(value, DTensor) else value
                views.whole_set(name, full.detach())
    finally:
        for module, attr, dparam in swapped:
            module._parameters[attr] = dparam


def _describe(value: object) -> tuple[Any, ...]:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, str(value.device))
    return ("value", value)


def register_whole_optimizer_state(optimizer: torch.optim.Optimizer, views: DTensorViews) -> None:
    """``optimizer.state_dict()`` gives the state of each whole-placed parameter as the
    row placement would (module note): tensors of the parameter's shape as its
    ``Shard(0)`` DTensor, 0-d counters as plain tensors alike on every rank, other tensors
    (Adafactor's factored row and column moments) as ``Replicate`` DTensors; one
    broadcast from the owner each, on every rank. ``load_state_dict`` takes that (or a
    row-placed optimizer's) back: the owner keeps the whole tensors."""
    names = {id(p): name for name, p in views.optimizer_named_parameters()}
    positions: list[tuple[int, str, torch.Size]] = []
    flat = [p for group in optimizer.param_groups for p in group["params"]]
    for index, p in enumerate(flat):
        inner = inner_of(p)
        if hasattr(inner, "_fsdp_whole_owner"):
            positions.append((index, names[id(inner)], p.shape))

    def to_rows(_optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        states = state_dict["state"]
        for index, name, shape in positions:
            mine = states.get(index) if views.whole_is_mine(name) else None
            desc = None if mine is None else {k: _describe(v) for k, v in mine.items()}
            desc = views.whole_owner_object(name, desc)
            states.pop(index, None)
            if desc is None:
                continue  # no state yet (never stepped): absent on every rank
            out: dict[str, Any] = {}
            for key, d in desc.items():  # type: ignore[union-attr]
                if d[0] == "value":
                    out[key] = d[1]
                    continue
                _, dims, dtype, device = d
                value = mine[key] if mine is not None else None
                full = views.whole_full(name, value, like=(torch.Size(dims), dtype))
                if dims == tuple(shape):
                    out[key] = views.whole_row_dtensor(name, full)
                elif not dims:
                    out[key] = full.to(device)
                else:
                    out[key] = views.whole_replicated(name, full)
            states[index] = out

    def from_rows(_optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        states = dict(state_dict["state"])
        for index, name, _shape in positions:
            saved = states.pop(index, None)
            if saved is None:
                continue
            whole = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in saved.items()}
            if views.whole_is_mine(name):
                states[index] = whole
        return {**state_dict, "state": states}

    optimizer.register_state_dict_post_hook(to_rows)
    optimizer.register_load_state_dict_pre_hook(from_rows)
