"""Global expert names in state dicts (expert parallelism).

Each expert-parallel (EP) rank holds different experts under the same local names: with
two local experts per rank, ``moe.experts.0`` is global expert 0 on EP rank 0 and global
expert 2 on EP rank 1. ``MegatronFSDP``'s state dicts name experts by their global
index, so that a checkpoint holds each expert once, under the name a one-process model
with every expert gives it, and loads at any EP size.

The rule (see also ``fsdp_hooks.features.experts``). An expert parameter's name must contain a
module whose name ends in ``experts`` followed by an index, e.g. ``moe.experts.1.w1``
or Megatron-Core's ``mlp.experts.local_experts.1.linear_fc1`` (the last such part
counts); the module before the index is an ``nn.ModuleList`` of this rank's local
experts. Local index ``i`` becomes global index ``ids[i]``, where ``ids`` is

1. ``local_expert_indices`` (Megatron-Core's MoE layer) or ``expert_ids``, a list of
   global indices, found on that ModuleList or else on its nearest enclosing module
   that has either;
2. otherwise Megatron-Core's contiguous convention ``ep_rank * num_local + i``, with
   ``num_local = len(ModuleList)``, which must be the same on every EP rank.

Every state dict key under ``<list>.<i>.`` is renamed (buffers too). Expert parameters
named otherwise (e.g. grouped 3-D expert weights) train as usual, but ``state_dict()``
then raises NotImplementedError naming them. The rule is applied only when experts
differ across ranks (an expert mesh whose data-parallel size differs from the dense one).

Names reach ``fsdp_ckpt`` (which maps parameters to keys by name) through the parameter
attribute ``_fsdp_state_dict_keys``: ``{name in the wrapped module: state dict key}``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn

__all__ = ["STATE_KEYS_ATTR", "ExpertStateNames", "LocalExperts", "global_expert_ids"]

# Read by fsdp_ckpt.names (which must not import fsdp_hooks) under the same name.
STATE_KEYS_ATTR = "_fsdp_state_dict_keys"
_INDEXED = re.compile(r"(?<![^.])(\w*experts)\.(\d+)(?=\.)")
_ID_ATTRS = ("local_expert_indices", "expert_ids")


@dataclass(frozen=True)
class LocalExperts:
    """What one rank says about its experts: its EP rank when the expert mesh tells it,
    and per expert ModuleList, its length and the global ids it carries (None: use
    the contiguous rule)."""

    ep_rank: int | None
    lists: dict[str, tuple[int, tuple[int, ...] | None]] = field(default_factory=dict)


def _split(name: str) -> tuple[str, int] | None:
    """``(ModuleList path, local index)`` of an expert name, None when it has none."""
    matches = list(_INDEXED.finditer(name))
    if not matches:
        return None
    return name[: matches[-1].end(1)], int(matches[-1].group(2))


def _carried_ids(root: nn.Module, path: str) -> tuple[int, ...] | None:
    parts = path.split(".")
    for depth in range(len(parts), -1, -1):
        module = root.get_submodule(".".join(parts[:depth]))
        for attr in _ID_ATTRS:
            ids = getattr(module, attr, None)
            if ids is not None:
                return tuple(int(i) for i in ids)
    return None


def _local_experts(
    root: nn.Module, expert_names: Iterable[str], ep_rank: int | None
) -> tuple[LocalExperts, list[str]]:
    """This rank's ``LocalExperts``, and the expert names the rule cannot place."""
    lists: dict[str, tuple[int, tuple[int, ...] | None]] = {}
    unplaced: list[str] = []
    for name in expert_names:
        split = _split(name)
        module = root.get_submodule(split[0]) if split else None
        if split is None or not isinstance(module, nn.ModuleList):
            unplaced.append(name)
        elif split[0] not in lists:
            lists[split[0]] = (len(module), _carried_ids(root, split[0]))
    return LocalExperts(ep_rank, lists), unplaced


def global_expert_ids(
    everyone: Sequence[LocalExperts], ep_size: int
) -> list[dict[str, tuple[int, ...]]]:
    """The global ids of every rank's local experts, per ModuleList, from what each rank
    said (the same answer on every rank). Raises ValueError when they do not number
    ``ep_size`` disjoint sets of experts."""
    paths = set(everyone[0].lists)
    if any(set(e.lists) != paths for e in everyone):
        raise ValueError(
            "the ranks hold different expert ModuleLists: "
            f"{sorted({p for e in everyone for p in e.lists} - paths)} are not on every rank"
        )
    out: list[dict[str, tuple[int, ...]]] = [{} for _ in everyone]
    for path in sorted(paths):
        counts = {e.lists[path][0] for e in everyone}
        for rank, experts in enumerate(everyone):
            num_local, ids = experts.lists[path]
            if ids is None:
                if len(counts) != 1:
                    raise ValueError(
                        f"{path!r} holds {sorted(counts)} experts on different ranks; the "
                        f"contiguous rule (global = ep_rank * num_local + local) needs the "
                        f"same number everywhere, or set local_expert_indices / expert_ids"
                    )
                if experts.ep_rank is None:
                    raise ValueError(
                        f"cannot tell the expert-parallel rank from the expert mesh (its "
                        f"dims besides the data-parallel and tp ones must be the EP dims); "
                        f"give {path!r} or its MoE module local_expert_indices or expert_ids"
                    )
                ids = tuple(experts.ep_rank * num_local + i for i in range(num_local))
            if len(ids) != num_local or len(set(ids)) != num_local:
                raise ValueError(
                    f"{path!r} holds {num_local} experts but its global ids are {list(ids)}; "
                    f"expected {num_local} distinct ids"
                )
            out[rank][path] = ids
        distinct = {r[path] for r in out}
        overlap = any(set(a) & set(b) for a in distinct for b in distinct if a != b)
        if overlap or len(distinct) != ep_size:
            raise ValueError(
                f"the global ids of {path!r} across ranks are {sorted(distinct)}; expected "
                f"{ep_size} disjoint sets (one per expert-parallel rank), or experts of "
                f"different ranks would share a state dict name"
            )
    return out


def _ep_rank(dist_index) -> tuple[int | None, int]:
    """This rank's EP rank (None when the expert mesh does not tell), and the EP size."""
    idx = dist_index
    ep_size = dist.get_world_size() // (idx.expt_dp_size * idx.expt_tp_size)
    mesh = idx.get_root_mesh(is_expert_parallel=True)
    known = {idx.dp_shard_dim, idx.dp_outer_dim, idx.tp_dim}
    coord = mesh.get_coordinate()
    assert coord is not None  # the expert mesh covers the world (FSDPDistributedIndex)
    rank, size = 0, 1
    for d, name in enumerate(mesh.mesh_dim_names or ()):
        if name not in known and mesh.size(d) > 1:
            rank, size = rank * mesh.size(d) + coord[d], size * mesh.size(d)
    return (rank if size == ep_size else None), ep_size


class ExpertStateNames:
    """The renaming of one wrapped module's expert keys, local <-> global."""

    def __init__(
        self, ids: Mapping[str, tuple[int, ...]] | None = None, error: Exception | None = None
    ) -> None:
        self.ids = dict(ids or {})
        self.to_local_index = {p: {g: i for i, g in enumerate(v)} for p, v in self.ids.items()}
        self.error = error

    @classmethod
    def build(cls, module: nn.Module, expert_names: Iterable[str], dist_index) -> ExpertStateNames:
        """Collective over the world (one ``all_gather_object``): every rank's experts
        are needed to check that the global ids of different EP ranks do not collide."""
        ep_rank, ep_size = _ep_rank(dist_index)
        mine, unplaced = _local_experts(module, expert_names, ep_rank)
        everyone: list[LocalExperts] = [mine] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if unplaced:  # same names on every rank: local experts share local names
            return cls(
                error=NotImplementedError(
                    f"state dicts of expert-parallel models need each expert parameter "
                    f"under '<...>experts.<local index>.' in an nn.ModuleList, to name it "
                    f"by its global expert index; these are not: {unplaced[:8]}"
                    f"{' ...' if len(unplaced) > 8 else ''} (e.g. grouped 3-D expert "
                    f"weights). Save them yourself, or split them per expert"
                )
            )
        try:
            ids = global_expert_ids(everyone, ep_size)[dist.get_rank()]
        except ValueError as err:
            return cls(error=err)
        return cls(ids)

    def _parse(self, key: str) -> tuple[str, int, str] | None:
        """``(list path, index, rest)`` when ``key`` is under an expert ModuleList."""
        dot = key.find(".")
        while dot >= 0:
            if key[:dot] in self.ids:
                index, sep, rest = key[dot + 1 :].partition(".")
                if sep and index.isdigit():
                    return key[:dot], int(index), rest
            dot = key.find(".", dot + 1)
        return None

    def to_global(self, key: str) -> str:
        parsed = self._parse(key)
        if parsed is None:
            return key
        path, local, rest = parsed
        return f"{path}.{self.ids[path][local]}.{rest}"

    def to_local(self, key: str) -> str | None:
        """The wrapped module's key for a global one; None for another rank's expert."""
        parsed = self._parse(key)
        if parsed is None:
            return key
        path, index, rest = parsed
        local = self.to_local_index[path].get(index)
        return None if local is None else f"{path}.{local}.{rest}"

    def tag(self, module: nn.Module) -> None:
        """Give each renamed parameter its keys (``STATE_KEYS_ATTR``) for fsdp_ckpt."""
        for name, param in module.named_parameters(remove_duplicate=False):
            if self._parse(name) is None:
                continue
            keys = getattr(param, STATE_KEYS_ATTR, None)
            if keys is None:
                keys = {}
                setattr(param, STATE_KEYS_ATTR, keys)
            keys[name] = self.to_global(name)
