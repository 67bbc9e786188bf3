"""Optimizer state dicts keyed by parameter name, not position.

``optimizer.state_dict()`` numbers parameters by their position in the param groups,
which changes with the wrapper, the strategy and tied-parameter handling. Here state
is ``{"state": {fqn: {"exp_avg": ..., "step": ...}}, "param_groups": [{..., "params":
[fqn, ...]}]}`` (the layout of ``torch.distributed.checkpoint.state_dict``), so a
checkpoint of a ZeRO-3 model loads into a plain module's plain optimizer.

Why not ``torch.distributed.checkpoint.state_dict.get_state_dict``: it names
parameters by ``model.named_parameters()`` (fsdp's wrapper adds ``module.``, its
``state_dict()`` does not), and its lazy state initialisation (one ``step()`` with zero
gradients) is skipped when gradients are attached, which fsdp's DTensor parameters
always are, so a fresh optimizer would silently load nothing. ``init_optimizer_state``
does that step on the optimizer class's own ``step`` (not an instance-level wrapper
that would also sync gradients and install weights), only for parameters that lack
state, with the learning rate at zero.

Several optimizers over disjoint parameters (fsdp's ``[Muon(hidden), AdamW(rest)]``)
make one such state dict (``optimizers_state_dict``): their states by parameter name,
their param groups one after the other, as torch's ``get_optimizer_state_dict(model,
[opt1, opt2])`` lays them out; ``split_optimizers_state_dict`` gives each its part back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_buffers.whole_param import inner_of
from fsdp_ckpt import _dist
from fsdp_ckpt.errors import CheckpointMismatchError
from fsdp_ckpt.names import entry_of, keys_may_differ_across_ranks, param_fqns
from fsdp_ckpt.row_shards import Entry, add_row_offsets, strip_row_offsets

__all__ = [
    "as_optimizer_list",
    "get_optimizer_state_dict",
    "init_optimizer_state",
    "optimizer_param_fqns",
    "optimizers_state_dict",
    "set_optimizer_state_dict",
    "split_optimizers_state_dict",
]


def _show(value: object) -> str:
    return f"{type(value).__name__} {value!r:.60}"


def as_optimizer_list(optimizer: object, where: str) -> list[torch.optim.Optimizer]:
    """``optimizer`` (None, an optimizer, or a list or tuple of optimizers over disjoint
    parameters) as a list; anything else raises ``TypeError`` saying what to pass, an
    empty list or one optimizer (or parameter) twice ``ValueError``. Local checks only:
    alike on every rank."""
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    allowed = (
        f"{where}: optimizer must be a torch.optim.Optimizer or a list of them (the list "
        "fsdp.fully_shard returns for several, e.g. [muon, adamw]), or None for the model "
        "alone"
    )
    if not isinstance(optimizer, list | tuple):
        raise TypeError(f"{allowed}; got {_show(optimizer)}")
    bad = [
        f"[{i}]: {_show(o)}"
        for i, o in enumerate(optimizer)
        if not isinstance(o, torch.optim.Optimizer)
    ]
    if bad:
        raise TypeError(f"{allowed}; got a {type(optimizer).__name__} holding {', '.join(bad)}")
    if not optimizer:
        raise ValueError(f"{where}: the list of optimizers is empty; pass None for the model alone")
    owner: dict[int, int] = {}
    for j, opt in enumerate(optimizer):
        if any(opt is other for other in optimizer[:j]):
            raise ValueError(f"{where}: optimizer {j} is in the list more than once")
        for p in _ordered_params(opt):
            if owner.setdefault(id(p), j) != j:
                raise ValueError(
                    f"{where}: a parameter of shape {tuple(p.shape)} is in optimizers "
                    f"{owner[id(p)]} and {j}; their states would collide under its name: "
                    "each parameter may be stepped by one optimizer only"
                )
    return list(optimizer)


def _ordered_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_param_fqns(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each of the optimizer's parameters, in its param-group order."""
    names = param_fqns(model, model.state_dict().keys())
    out: list[str] = []
    unknown: list[str] = []
    for p in _ordered_params(optimizer):
        name = names.get(p)
        if name is None:
            unknown.append(f"{type(p).__name__}{tuple(p.shape)}")
        else:
            out.append(name)
    if unknown:
        raise ValueError(
            f"the optimizer holds {len(unknown)} parameter(s) that are not the model's "
            f"(e.g. {unknown[:3]}); build the optimizer over model.parameters(), after "
            f"wrapping when the wrapper replaces parameters"
        )
    return out


def get_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, ready for DCP: state tensors are
    the live ones, and those shaped like an fsdp parameter carry its row offsets, so
    ``dcp.load`` into the result writes into the optimizer's state. Parameters with no
    state yet (never stepped) are absent from ``"state"``. When keys may differ across
    ranks (expert parallelism, see ``names``), the groups' ``params`` list every rank's
    names: one ``all_gather_object``, so every rank must call it then."""
    fqns = optimizer_param_fqns(model, optimizer)
    params = _ordered_params(optimizer)
    osd = optimizer.state_dict()
    entries: dict[tuple[str, str], Entry] = {}
    for index, state in osd["state"].items():
        param = params[index]
        # A whole-placed parameter's entries (fsdp's whole placement) are converted by its
        # state_dict hook into the row placement's DTensors: not the owner's live tensors.
        live = {} if hasattr(param, "_fsdp_whole_owner") else optimizer.state.get(param, {})
        for key, value in state.items():
            # The live tensor: a wrapper's state_dict hook may have replaced the entry
            # (fsdp refuses positional expert state in plain DCP; names are unambiguous).
            value = live.get(key, value)
            like_param = isinstance(value, DTensor) and value.shape == param.shape
            entries[(fqns[index], key)] = entry_of(value, param if like_param else None)
    flat = add_row_offsets({f"{fqn}\x00{key}": v for (fqn, key), v in entries.items()})
    state_out: dict[str, dict[str, Any]] = {}
    for flat_key, value in flat.items():
        fqn, key = flat_key.split("\x00")
        state_out.setdefault(fqn, {})[key] = value
    groups = []
    for group in osd["param_groups"]:
        saved = {k: v for k, v in group.items() if k != "params"}
        saved["params"] = [fqns[i] for i in group["params"]]
        groups.append(saved)
    if keys_may_differ_across_ranks(params):
        groups = _names_of_every_rank(groups)
    return {"state": state_out, "param_groups": groups}


def optimizers_state_dict(
    model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]
) -> dict[str, Any]:
    """``get_optimizer_state_dict`` of several optimizers over disjoint parameters, as
    one: states by parameter name, param groups one after the other."""
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for optimizer in optimizers:
        osd = get_optimizer_state_dict(model, optimizer)
        state.update(osd["state"])
        groups.extend(osd["param_groups"])
    return {"state": state, "param_groups": groups}


def split_optimizers_state_dict(
    state_dict: Mapping[str, Any], optimizers: Sequence[torch.optim.Optimizer]
) -> list[dict[str, Any]]:
    """Each optimizer's part of ``state_dict`` (as ``optimizers_state_dict`` joins
    them): its groups by position, the state of the parameters they name."""
    groups = list(state_dict.get("param_groups", []))
    state = state_dict.get("state", {})
    if len(optimizers) == 1:
        return [{"state": dict(state), "param_groups": groups}]
    parts, start = [], 0
    for optimizer in optimizers:
        mine = groups[start : start + len(optimizer.param_groups)]
        start += len(optimizer.param_groups)
        names = {n for g in mine for n in g.get("params", [])}
        parts.append(
            {"state": {k: v for k, v in state.items() if k in names}, "param_groups": mine}
        )
    return parts


def _names_of_every_rank(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``groups`` whose ``params`` list the names of every rank (in rank order), the
    same everywhere: DCP keeps one rank's copy of such non-tensor entries, and names
    differ across ranks under expert parallelism. A collective."""
    everyone = _dist.all_gather_object([g["params"] for g in groups])
    if any(len(lists) != len(groups) for lists in everyone):
        raise ValueError(
            f"the optimizers hold {sorted({len(lists) for lists in everyone})} param groups "
            f"on different ranks; build them with the same groups on every rank"
        )
    return [
        {**group, "params": list(dict.fromkeys(n for lists in everyone for n in lists[g]))}
        for g, group in enumerate(groups)
    ]


def check_param_groups(
    model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The optimizer's param groups with the saved hyperparameters, for
    ``optimizer.load_state_dict``; raises ``CheckpointMismatchError`` unless the saved
    groups (``state_dict["param_groups"]``) hold the same parameter names, by position
    (with keys that differ across ranks: this rank's names must be among the saved
    ones, and none of the others a name of this model outside the group). Frozen
    parameters never have state: a wrapped optimizer leaves them out of its groups, a
    plain one built over ``model.parameters()`` keeps them; either matches."""
    fqns = optimizer_param_fqns(model, optimizer)
    # Saved groups then list every rank's names; only names this model has can clash.
    elsewhere = keys_may_differ_across_ranks(_ordered_params(optimizer))
    names = param_fqns(model, model.state_dict().keys())
    own = set(names.values()) if elsewhere else set()
    frozen = {fqn for p, fqn in names.items() if not p.requires_grad}
    saved_groups = list(state_dict.get("param_groups", []))
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointMismatchError(
            f"the saved optimizer state has {len(saved_groups)} param group(s), this "
            f"optimizer {len(optimizer.param_groups)}; build the optimizer with the same "
            f"groups as the one that was saved"
        )
    groups = []
    start = 0
    for g, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups, strict=True)):
        mine = fqns[start : start + len(group["params"])]
        theirs = set(saved.get("params", []))
        only_theirs = theirs - set(mine) - frozen
        if elsewhere:
            only_theirs &= own
        only_mine = set(mine) - theirs - frozen
        if only_theirs or only_mine:
            raise CheckpointMismatchError(
                f"param group {g} holds different parameters: only in the checkpoint "
                f"{sorted(only_theirs)}, only in this optimizer {sorted(only_mine)}"
            )
        merged = {k: v for k, v in group.items() if k != "params"}
        merged.update({k: v for k, v in saved.items() if k != "params"})
        merged["params"] = list(range(start, start + len(mine)))
        groups.append(merged)
        start += len(mine)
    return groups


def set_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> None:
    """Load a name-keyed optimizer state dict (from ``get_optimizer_state_dict``, maybe
    of another world size, strategy or wrapper). Param groups are matched by position
    and must hold the same names (see ``check_param_groups``); their hyperparameters
    come from ``state_dict`` (keys it lacks keep their current values). State replaces
    the current state."""
    fqns = optimizer_param_fqns(model, optimizer)
    index_of = {fqn: i for i, fqn in enumerate(fqns)}
    groups = check_param_groups(model, optimizer, state_dict)
    unknown = sorted(set(state_dict.get("state", {})) - set(index_of))
    if unknown:
        raise CheckpointMismatchError(
            f"the saved optimizer state has entries for parameters this model does not "
            f"have: {unknown}"
        )
    state = {
        index_of[fqn]: strip_row_offsets(dict(values))
        for fqn, values in state_dict.get("state", {}).items()
    }
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def init_optimizer_state(
    optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter] | None = None
) -> None:
    """Create the state of ``params`` (default: every parameter) that has none, by one
    ``step`` of the optimizer's class with zero gradients and learning rate zero, so
    that ``dcp.load`` has tensors to load into. Parameters that already have state,
    and their gradients, are left as they were."""
    wanted = list(_ordered_params(optimizer) if params is None else params)
    # fsdp's whole-placed parameters step through their inner tensor (a meta placeholder
    # on the ranks that do not own it: no state there); fsdp swaps them in for this.
    wanted = [inner_of(p) for p in wanted]
    swap = getattr(optimizer, "_fsdp_inner_parameters", None)
    with swap() if swap is not None else contextlib.nullcontext():
        todo = {p for p in wanted if not p.is_meta and not optimizer.state.get(p)}
        if todo:
            _step_with_zero_grads(optimizer, todo)


def _step_with_zero_grads(optimizer: torch.optim.Optimizer, todo: set[nn.Parameter]) -> None:
    saved_grads = {}
    saved_lrs = []
    try:
        for p in _ordered_params(optimizer):
            saved_grads[p] = p.grad
            p.grad = torch.zeros_like(p) if p in todo else None
        for group in optimizer.param_groups:
            saved_lrs.append(group.get("lr"))
            if "lr" in group:
                lr = group["lr"]
                group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
        with torch.no_grad():
            type(optimizer).step(optimizer)
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs, strict=False):
            if "lr" in group:
                group["lr"] = lr
        for p, grad in saved_grads.items():
            p.grad = grad
