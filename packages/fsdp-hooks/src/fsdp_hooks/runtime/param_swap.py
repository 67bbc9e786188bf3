"""Which tensor each module attribute holds: the compute parameter (a view into its
gathered bucket) or its DTensor (this rank's shard of the main weights).

``FSDPHooks`` extends ``ParamSwapping``. Outside forward and backward every location
holds its DTensor, so torch's tools see the sharded parameters; the root pre-forward
puts the compute parameters in place, and while a unit's buckets are released its own
locations hold the DTensors again (reading a compute parameter then would read freed
memory; autograd refuses one it saved: Note [released weights read later] in
``saved_weight_hooks``). Every place a parameter is reachable from is a location, so
tied weights swap together. Under ZeRO-1/2 with ``overlap_param_gather``, a bucket whose install has not
landed keeps its DTensors in place inside the forward too, until the first unit that
uses it lands it (Note [deferred install] in ``fsdp_buffers.deferred_install``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from fsdp_buffers import ParamAndGradBuffer
    from fsdp_hooks.runtime.hooks import FSDPUnit
    from fsdp_hooks.runtime.saved_weight_hooks import SavedWeightHooks

__all__ = ["ParamSwapping"]


class ParamSwapping:
    """The parameter-swapping half of ``FSDPHooks`` (see the module docstring)."""

    buffer: ParamAndGradBuffer
    units: list[FSDPUnit]
    _locations: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]]
    _using_compute: bool
    distributed_by_compute: dict[nn.Parameter, nn.Parameter]
    deferred_installs: frozenset[int]
    _install_swaps: dict[int, list[tuple[nn.Module, dict, dict]]]
    _saved_weights: SavedWeightHooks

    def _init_locations(
        self, module: nn.Module, by_param: dict[nn.Parameter, nn.Parameter]
    ) -> None:
        """Record every (module, attribute) holding a parameter, with its DTensor
        counterpart ``by_param[p]``, and give each unit the ones it frees."""
        self._locations = []
        for sub in module.modules():
            for attr, p in sub._parameters.items():
                if p is not None:
                    self._locations.append((sub, attr, p, by_param[p]))
        self._using_compute = True
        self.distributed_by_compute = by_param
        self._assign_unit_locations()

    def use_compute_params(self) -> None:
        if not self._using_compute:
            for module, attr, compute, _dist in self._locations:
                module._parameters[attr] = compute
            self._using_compute = True

    def use_distributed_params(self) -> None:
        self._saved_weights.hide_all()  # every bucket is released with it
        if self._using_compute:
            for module, attr, _compute, dparam in self._locations:
                module._parameters[attr] = dparam
            self._using_compute = False

    def _assign_unit_locations(self) -> None:
        """Give each unit the parameter locations it frees: those of modules inside it
        (the innermost unit, when units nest) whose bucket it releases and whose compute
        weights are sharded (else the bucket is never freed)."""
        owner: dict[nn.Module, FSDPUnit] = {}
        for unit in sorted(self.units, key=lambda u: u.name.count(".") + bool(u.name)):
            for sub in unit.module.modules():
                owner[sub] = unit  # deeper units come later and win
        for module, attr, compute, dparam in self._locations:
            unit = owner.get(module)
            if unit is None:
                continue
            gid = self.buffer.group_of(compute)[0]
            if gid in unit.release_groups and self.buffer.buckets[gid].is_distributed:
                unit.locations.append((module, attr, compute, dparam))
        for unit in self.units:  # one dict update per module and direction
            by_module: dict[nn.Module, tuple[dict, dict]] = {}
            for module, attr, compute, dparam in unit.locations:
                to_compute, to_dist = by_module.setdefault(module, ({}, {}))
                to_compute[attr], to_dist[attr] = compute, dparam
            unit.swaps = [(m, c, d) for m, (c, d) in by_module.items()]

    def _init_install_swaps(self) -> None:
        """Which buckets' installs may be left to the forward (Note [deferred install]
        in ``fsdp_buffers.deferred_install``): of the buffer's ``deferrable_installs``,
        those every location of which is inside a unit with gathering hooks (whose
        pre-forward, the first to run, lands it); and their locations, by bucket."""
        inside: set[nn.Module] = set()
        for unit in self.units:
            if unit.on_pre_backward is not None:  # a unit with gathering hooks
                inside.update(unit.module.modules())
        by_gid: dict[int, dict[nn.Module, tuple[dict, dict]]] = {}
        blocked: set[int] = set()
        for module, attr, compute, dparam in self._locations:
            gid = self.buffer.group_of(compute)[0]
            if module not in inside:
                blocked.add(gid)
            to_compute, to_dist = by_gid.setdefault(gid, {}).setdefault(module, ({}, {}))
            to_compute[attr], to_dist[attr] = compute, dparam
        self.deferred_installs = frozenset(
            g for g in self.buffer.deferrable_installs() if g in by_gid and g not in blocked
        )
        self._install_swaps = {
            g: [(m, c, d) for m, (c, d) in by_gid[g].items()] for g in self.deferred_installs
        }

    def _hold_pending_installs(self) -> None:
        """Root pre-forward: locations of buckets whose install has not landed keep
        their DTensors (the updated main weights), so nothing reads stale weights."""
        swaps = self._install_swaps
        for gid in self.buffer.installs.pending:
            for module, _to_compute, to_dist in swaps.get(gid, ()):
                module._parameters.update(to_dist)

    def land_installs(self, gids: list[int] | None = None) -> None:
        """Land the deferred installs of ``gids`` (and those queued before them; all
        when None) and, inside a forward, put their compute parameters in place."""
        installs = self.buffer.installs
        if gids is None:
            landed = installs.land_all()
        else:
            landed = []
            for gid in gids:
                if gid in installs.pending:
                    landed += installs.land(gid)
        if self._using_compute:
            swaps = self._install_swaps
            for gid in landed:
                for module, to_compute, _to_dist in swaps.get(gid, ()):
                    module._parameters.update(to_compute)

    def _unit_use(self, unit: FSDPUnit, compute: bool) -> None:
        if compute:
            self._saved_weights.show(unit)
        else:
            self._saved_weights.hide(unit)
        # Outside the compute phase every location already holds its DTensor.
        if self._using_compute:
            if compute:
                for module, to_compute, _to_dist in unit.swaps:
                    module._parameters.update(to_compute)
            else:
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
