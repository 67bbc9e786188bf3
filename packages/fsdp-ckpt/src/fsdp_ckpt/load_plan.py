"""What ``load_checkpoint`` hands to ``dcp.load``: the live model and optimizer state
under the keys the checkpoint's ``Layout`` gives them (so DCP loads in place), and
placeholders for the param groups; checked against the checkpoint's metadata first,
so that every mismatch is reported by name before anything is read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fsdp_ckpt.layout import Layout
from fsdp_ckpt.optim_state import (
    init_optimizer_state,
    optimizer_param_fqns,
    optimizers_state_dict,
    split_optimizers_state_dict,
)
from fsdp_ckpt.validate import Mismatch, find_mismatches, flatten

__all__ = ["OptimizerPlan", "nest", "plan_model", "plan_optimizer"]


def nest(root: dict[str, Any], prefix: str, value: dict[str, Any]) -> dict[str, Any]:
    """Put ``value``'s entries at ``prefix`` ("a.b." -> ``root["a"]["b"]``, "" -> in
    ``root``), where DCP's flattening names them ``prefix + key``; returns the dict
    that holds them (DCP writes loaded non-tensors there)."""
    node = root
    for part in prefix.split(".")[:-1]:
        node = node.setdefault(part, {})
    node.update(value)
    return node


def plan_model(
    model_sd: dict[str, Any], metadata: Metadata, layout: Layout, *, strict: bool
) -> Mismatch:
    """What is wrong between the model's state dict and the checkpoint's model part,
    seen from this rank (``Mismatch.combine`` merges the ranks' findings)."""
    # Named as DCP names what it saves: a dict value (a module's extra state, say) by
    # its leaves.
    ours = flatten(model_sd, layout.model_prefix.removesuffix("."))
    return find_mismatches(ours, layout.model_entries(metadata), strict=strict)


def _placeholder(md: object) -> torch.Tensor | None:
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(md.size, dtype=md.properties.dtype)
    return None  # DCP puts the unpickled value here


def _saved_state_fqns(metadata: Metadata, fqns: list[str], prefix: str) -> set[str]:
    """The parameters among ``fqns`` that have optimizer state in the checkpoint
    (keys ``<prefix><fqn>.<state name>``)."""
    wanted = set(fqns)
    found: set[str] = set()
    for key in metadata.state_dict_metadata:
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix) :]
        dot = rest.rfind(".")
        while dot > 0:
            if rest[:dot] in wanted:
                found.add(rest[:dot])
                break
            dot = rest.rfind(".", 0, dot)
    return found


def _entries_under(metadata: Metadata, prefix: str, *, by_name: bool) -> dict[str, dict[str, Any]]:
    """``<prefix><head>.<name>`` entries as ``{head: {name: placeholder}}``. The head
    is a group index, or a parameter name (which has dots, unlike hyperparameters)."""
    out: dict[str, dict[str, Any]] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(prefix):
            rest = key[len(prefix) :]
            head, _, name = rest.rpartition(".") if by_name else rest.partition(".")
            out.setdefault(head, {})[name] = _placeholder(md)
    return out


@dataclass
class OptimizerPlan:
    """The optimizers' part of the state given to ``dcp.load`` (one optimizer, or
    several over disjoint parameters, joined as ``optimizers_state_dict`` joins them),
    and how to read the loaded result back as each one's name-keyed state dict."""

    optimizers: list[torch.optim.Optimizer]
    prefix: str  # where the checkpoint keeps the optimizer, e.g. "optim."
    to_load: dict[str, Any]  # {"state": ..., "param_groups": ...}
    group_fqns: list[list[str]]  # this optimizer's groups, by parameter name
    by_name: bool
    state_mismatch: Mismatch  # this rank's, to combine with the others'
    problems: list[str]  # about param groups

    def loaded(self, node: dict[str, Any]) -> dict[str, Any]:
        """The state dict for ``set_optimizer_state_dict`` from the loaded ``node``."""
        groups = node["param_groups"]
        if self.by_name:  # hyperparameters stored per parameter: the group's first
            groups = [{**groups.get(g[0], {}), "params": g} if g else {} for g in self.group_fqns]
        return {"state": node["state"], "param_groups": groups}

    def parts(self, node: dict[str, Any]) -> list[tuple[torch.optim.Optimizer, dict[str, Any]]]:
        """Each optimizer with its part of ``loaded(node)``."""
        split = split_optimizers_state_dict(self.loaded(node), self.optimizers)
        return list(zip(self.optimizers, split, strict=True))


def plan_optimizer(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    metadata: Metadata,
    layout: Layout,
) -> OptimizerPlan:
    """The optimizers' live state (created where the checkpoint has some and the
    optimizer has none yet) for the parameters the checkpoint has state for, and
    placeholders for the saved param groups."""
    prefix = layout.optim_prefix
    if prefix is None:
        raise ValueError(f"plan_optimizer needs a layout with optimizer state; got {layout}")
    fqns = {id(o): optimizer_param_fqns(model, o) for o in optimizers}
    state_prefix, groups_prefix = prefix + "state.", prefix + "param_groups."
    saved = _saved_state_fqns(metadata, [f for o in fqns.values() for f in o], state_prefix)
    for optimizer in optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        init_optimizer_state(
            optimizer,
            [p for p, fqn in zip(params, fqns[id(optimizer)], strict=True) if fqn in saved],
        )
    osd = optimizers_state_dict(model, optimizers)
    state = {fqn: v for fqn, v in osd["state"].items() if fqn in saved}
    state_saved = {
        k: md for k, md in metadata.state_dict_metadata.items() if k.startswith(state_prefix)
    }
    state_mismatch = find_mismatches(flatten(state, prefix + "state"), state_saved)
    problems: list[str] = []

    group_fqns = [list(g["params"]) for g in osd["param_groups"]]
    entries = _entries_under(metadata, groups_prefix, by_name=layout.groups_by_name)
    if layout.groups_by_name:
        missing = sorted(f for g in group_fqns for f in g if f not in entries)
        if missing:
            problems.append(
                "param group hyperparameters missing from the checkpoint for: "
                + ", ".join(groups_prefix + f for f in missing)
            )
        groups: Any = {g[0]: entries[g[0]] for g in group_fqns if g and g[0] in entries}
    else:
        heads = sorted(entries, key=lambda h: (not h.isdigit(), int(h) if h.isdigit() else 0))
        if not all(h.isdigit() for h in heads):
            problems.append(f"param group entries not numbered: {groups_prefix}{heads[-1]}.*")
        groups = [entries[h] for h in heads if h.isdigit()]
        if len(groups) != len(group_fqns):
            these = "this optimizer" if len(optimizers) == 1 else "these optimizers together"
            problems.append(
                f"the checkpoint has {len(groups)} optimizer param group(s), {these} "
                f"{len(group_fqns)}"
            )
    return OptimizerPlan(
        optimizers=list(optimizers),
        prefix=prefix,
        to_load={"state": state, "param_groups": groups},
        group_fqns=group_fqns,
        by_name=layout.groups_by_name,
        state_mismatch=state_mismatch,
        problems=problems,
    )
