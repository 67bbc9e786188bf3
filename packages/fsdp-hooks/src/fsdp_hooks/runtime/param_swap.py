"""Which tensor each module attribute holds: the compute parameter (a view into its
gathered bucket) or its DTensor (this rank's shard of the main weights).

``FSDPHooks`` owns one ``ParamSwapping``; each ``UnitGroup`` swaps its members through
it. Outside forward and backward every location
holds its DTensor, so torch's tools see the sharded parameters; the root pre-forward
puts the compute parameters in place, and while a unit's buckets are released its own
locations hold the DTensors again (reading a compute parameter then would read freed
memory; autograd refuses one it saved: Note [released weights read later] in
``saved_weight_hooks``). Every place a parameter is reachable from is a location, so
tied weights swap together. Under ZeRO-1/2 a unit's buckets are never released, but an
optimizer step may leave them STALE (Note [stale buckets] in
``fsdp_buffers.all_gather_pipeline``): then its locations hold the DTensors (the updated
main weights) from the root pre-forward until its pre-forward gathers them, as a
released unit's do, so nothing computes with the weights of the step before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import nn

from fsdp_buffers import BucketStatus, ParamAndGradBuffer
from fsdp_hooks.runtime.unit import FSDPUnit

__all__ = ["ParamSwapping", "SwapPlan", "VersionGuard", "plan_swaps"]


class VersionGuard(Protocol):
    """What a swap tells about a unit's weights (``SavedWeightHooks``: readable or not
    by a backward that saved them)."""

    def show(self, unit: FSDPUnit) -> None: ...

    def hide(self, unit: FSDPUnit) -> None: ...

    def hide_all(self) -> None: ...


Location = tuple[nn.Module, str, nn.Parameter, nn.Parameter]  # (module, attr, compute, DTensor)


@dataclass(frozen=True)
class SwapPlan:
    """Where each parameter is reachable from, decided at wrap (``plan_swaps``)."""

    locations: tuple[Location, ...]  # every (module, attribute) holding a parameter
    kept_units: frozenset[FSDPUnit]  # units whose ZeRO-1/2 buckets a step may leave stale
    stale_after_step: frozenset[int]  # buckets an optimizer step may leave stale


def plan_swaps(
    module: nn.Module,
    buffer: ParamAndGradBuffer,
    units: list[FSDPUnit],
    by_param: dict[nn.Parameter, nn.Parameter],
) -> SwapPlan:
    """Record every (module, attribute) holding a parameter, with its DTensor
    counterpart ``by_param[p]``, and give each unit the locations it swaps: those of
    modules inside it (the innermost unit, when units nest) whose bucket it gathers and
    either releases (compute weights sharded: ``unit.locations``, the ones it frees) or
    keeps (ZeRO-1/2 buckets a step may leave stale, ``Bucket.can_be_stale``), as
    ``unit.swaps``. Buckets an optimizer step may leave stale: root buckets (the root
    pre-forward gathers them before anything runs) and buckets every location of which
    a unit with gathering hooks swaps (its pre-forward, the first to run, gathers them)."""
    locations: list[Location] = []
    for sub in module.modules():
        for attr, p in sub._parameters.items():
            if p is not None:
                locations.append((sub, attr, p, by_param[p]))
    owner: dict[nn.Module, FSDPUnit] = {}
    for unit in sorted(units, key=lambda u: u.name.count(".") + bool(u.name)):
        for sub in unit.module.modules():
            owner[sub] = unit  # deeper units come later and win
    buckets = buffer.buckets
    swapped: dict[FSDPUnit, list[Location]] = {}
    blocked: set[int] = set()
    kept: set[FSDPUnit] = set()
    for location in locations:
        sub, _attr, compute, _dparam = location
        gid = buffer.group_of(compute)[0]
        bucket = buckets[gid]
        unit = owner.get(sub)
        if (
            unit is None
            or not unit.hooked  # no gathering hooks
            or gid not in unit.release_groups
            or not (bucket.is_distributed or bucket.can_be_stale)
        ):
            blocked.add(gid)
            continue
        swapped.setdefault(unit, []).append(location)
        if bucket.is_distributed:
            unit.locations.append(location)
        else:
            kept.add(unit)  # ZeRO-1/2: swapped only while stale
    root = set(buffer.root_groups)
    stale = frozenset(
        b.gid for b in buckets if b.can_be_stale and (b.gid in root or b.gid not in blocked)
    )
    for unit, unit_locations in swapped.items():  # one dict update per module and direction
        by_module: dict[nn.Module, tuple[dict, dict]] = {}
        for sub, attr, compute, dparam in unit_locations:
            to_compute, to_dist = by_module.setdefault(sub, ({}, {}))
            to_compute[attr], to_dist[attr] = compute, dparam
        unit.swaps = [(m, c, d) for m, (c, d) in by_module.items()]
    return SwapPlan(tuple(locations), frozenset(kept), stale)


class ParamSwapping:
    """Which tensor each module attribute holds (see the module docstring): every
    location at once (``use_compute_params``/``use_distributed_params``) or one unit's
    (``unit_use``), telling ``guard`` which units' weights are readable."""

    def __init__(
        self,
        buffer: ParamAndGradBuffer,
        plan: SwapPlan,
        by_param: dict[nn.Parameter, nn.Parameter],
        guard: VersionGuard,
    ) -> None:
        self.buffer = buffer
        self.locations = plan.locations
        self.stale_after_step = plan.stale_after_step
        self._kept_units = plan.kept_units
        self.distributed_by_compute = by_param
        self._guard = guard
        self._using_compute = True

    @property
    def using_compute(self) -> bool:
        """Whether the locations hold the compute parameters (forward to end of backward)."""
        return self._using_compute

    def use_compute_params(self) -> None:
        if not self._using_compute:
            for module, attr, compute, _dist in self.locations:
                module._parameters[attr] = compute
            self._using_compute = True

    def use_distributed_params(self) -> None:
        self._guard.hide_all()  # every bucket is released with it
        if self._using_compute:
            for module, attr, _compute, dparam in self.locations:
                module._parameters[attr] = dparam
            self._using_compute = False

    def hold_stale_units(self) -> None:
        """Root pre-forward: units whose buckets are not current (STALE after a step, or
        their gather in flight) hold their DTensors until their pre-forward."""
        buckets = self.buffer.buckets
        for unit in self._kept_units:
            if any(buckets[g].status is not BucketStatus.READY_TO_USE for g in unit.release_groups):
                for module, _to_compute, to_dist in unit.swaps:
                    module._parameters.update(to_dist)

    def unit_use(self, unit: FSDPUnit, compute: bool) -> None:
        """``unit``'s locations hold its compute parameters (``compute``) or its DTensors."""
        if compute:
            self._guard.show(unit)
        else:
            self._guard.hide(unit)
        # Outside the compute phase every location already holds its DTensor. A unit
        # whose buckets stay gathered (ZeRO-1/2) keeps its compute parameters.
        if self._using_compute:
            if compute:
                for module, to_compute, _to_dist in unit.swaps:
                    module._parameters.update(to_compute)
            elif unit not in self._kept_units:
                for module, _to_compute, to_dist in unit.swaps:
                    module._parameters.update(to_dist)

    def group_of_any(self, param: nn.Parameter) -> int:
        """Bucket of a compute parameter or of its DTensor counterpart."""
        if param in self.buffer.param_index:
            return self.buffer.group_of(param)[0]
        index = getattr(param, "_fsdp_group_index", None)
        if index is not None:
            return index[0]
        for compute, dparam in self.distributed_by_compute.items():
            if dparam is param:
                return self.buffer.group_of(compute)[0]
        raise KeyError("parameter is not managed by this MegatronFSDP model")
