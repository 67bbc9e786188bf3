"""Which tensor each module attribute holds, and what guards reads of released weights.

``ParamSwapping``: each location (module attribute) holds the compute parameter (a view
into its gathered bucket) or its DTensor (this rank's shard of the main weights).
``FSDPHooks`` owns one; each ``UnitGroup`` swaps its members through it. Outside forward
and backward every location holds its DTensor, so torch's tools see the sharded
parameters; the root pre-forward puts the compute parameters in place, and while a
unit's buckets are released its own locations hold the DTensors again (reading a
compute parameter then would read freed memory; autograd refuses one it saved: Note
[released weights read later]). Every place a parameter is reachable from is a
location, so tied weights swap together. Under ZeRO-1/2 a unit's buckets are never
released, but an optimizer step may leave them STALE (Note [stale buckets] in
``fsdp_buffers.all_gather_pipeline``): then its locations hold the DTensors (the updated
main weights) from the root pre-forward until its pre-forward gathers them, as a
released unit's do, so nothing computes with the weights of the step before.

``SavedWeightHooks``: reads of a unit's weights after ZeRO-3 released them, refused,
copied or gathered. Each swap tells it which units' weights are readable
(``VersionGuard``).

Note [released weights read later]

ZeRO-3 releases a unit's buckets after its forward and after its backward; its compute
parameters are then views of freed storage (or, with ``fsdp_double_buffer``, of a slot
another unit's weights fill next). Anything that reads them there would crash or be
silently wrong. Three ways to get there, and what ``SavedWeightHooks`` does about each:

1. A tensor autograd saved for backward, read by a backward that reaches the weights
   without going through the unit's outputs first (an auxiliary loss kept on the module,
   ``self.aux = f(self.fc.weight)``, backpropagated on its own). By default the
   released compute parameters carry a version one past the one autograd saved them at
   (``hide``/``show``, at each swap of ``ParamSwapping.unit_use``), so autograd refuses
   the read with its own error ("modified by an inplace operation ... is at version")
   before any kernel touches the memory; a gradient that still arrives by another route
   raises naming the unit (``check_side_path``). With ``regather_saved_weights=True`` at
   wrap, saved-tensor hooks around the forward pack a unit weight as a reference and
   unpacking it gathers its bucket again (``saved_weights_hooks``); a custom Function's
   backward then gets a ``SavedParameter`` (``saved_weights``). Off by default: hooks
   cost a Python call per saved tensor, and any hooks make autograd hand backward a
   copy of a saved parameter without its attributes.
2. A unit output that is a view of its own parameter (``self.q.expand(B, -1, -1)``,
   ``self.pe[:T]``): copied out at the unit's post-forward, before the release
   (``copy_out_views``). Cost: one copy of each such output, at its full size.
3. A second backward through a graph built by a backward (``create_graph=True``: a
   gradient penalty, a Hessian-vector product): the nodes that backward creates save the
   weights without any hook of ours and read them after the unit's post-backward
   released them. Refused when that backward starts (``check_double_backward``), naming
   fsdp, the unit and double backward.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from fsdp_buffers import AllGatherPipeline, BucketStatus, ParamAndGradBuffer
from fsdp_hooks.runtime.backward import flatten_tensors, map_tensors, storage_key
from fsdp_hooks.runtime.saved_weights import unpacked_for_python
from fsdp_hooks.runtime.training_state import TrainingState
from fsdp_hooks.runtime.unit import FSDPUnit
from fsdp_mesh.device import warn_once

__all__ = ["ParamSwapping", "SavedWeightHooks", "SwapPlan", "VersionGuard", "plan_swaps"]


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
        # Whether the locations hold the compute parameters (forward to end of backward).
        self.using_compute = True

    def use_compute_params(self) -> None:
        if not self.using_compute:
            for module, attr, compute, _dist in self.locations:
                module._parameters[attr] = compute
            self.using_compute = True

    def use_distributed_params(self) -> None:
        self._guard.hide_all()  # every bucket is released with it
        if self.using_compute:
            for module, attr, _compute, dparam in self.locations:
                module._parameters[attr] = dparam
            self.using_compute = False

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
        if self.using_compute:
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


class _Owner(Protocol):
    """What these hooks read of the ``FSDPHooks`` that owns them."""

    buffer: ParamAndGradBuffer
    gather: AllGatherPipeline
    units: list[FSDPUnit]
    root_groups: list[int]
    param_names: dict[nn.Parameter, str]

    def begin_backward(self) -> None: ...


# Read until 2026-11: on by default, "0" turned regathering off. Now only warned about.
_REGATHER_ENV = "FSDP_REGATHER_SAVED_WEIGHTS"
# Sets each tensor's version counter (tuples of tensors and versions: torch >= 2.7).
_set_versions = torch._C._autograd._unsafe_set_version_counter


@dataclass(frozen=True, eq=False)
class _SavedWeight:
    """A unit's compute weight saved for backward, and its bucket."""

    weight: torch.Tensor
    gid: int


class SavedWeightHooks:
    """The released unit weights of one ``FSDPHooks`` and what guards reads of them
    (see Note [released weights read later])."""

    def __init__(self, hooks: _Owner, regather: bool) -> None:
        self._hooks = hooks
        self.regather_saved_weights = regather
        # id of each compute parameter a unit frees after its forward -> (bucket, unit).
        # Keyed by id for the pack hook, called for every saved tensor (a tensor's
        # __hash__ is a Python call); the parameters live as long as the wrapper.
        self._released_by_id: dict[int, tuple[int, FSDPUnit]] = {
            id(compute): (hooks.buffer.group_of(compute)[0], unit)
            for unit in hooks.units
            for _m, _a, compute, _d in unit.locations
        }
        # Per unit: its released compute parameters (each once) and, per bucket, one of
        # them (whose storage is the bucket's).
        self._weights: list[tuple[nn.Parameter, ...]] = []
        self._bucket_reps: list[tuple[nn.Parameter, ...]] = []
        for unit in hooks.units:
            params = tuple(dict.fromkeys(c for _m, _a, c, _d in unit.locations))
            by_gid = {hooks.buffer.group_of(p)[0]: p for p in params}
            self._weights.append(params)
            self._bucket_reps.append(tuple(by_gid.values()))
        # Units whose weights are readable now, and the version each hidden parameter
        # was saved at (restored when it is readable again). Wrapped: all released.
        self._shown: set[int] = {unit.index for unit in hooks.units}
        self._hidden: dict[int, int] = {}
        for unit in hooks.units:
            self.hide(unit)
        self._units_released = [unit.name for unit in hooks.units if self._weights[unit.index]]
        # One compute parameter of each root bucket released at the end of a step
        # (ZeRO-3: its storage is the bucket's), for outputs that view it.
        self._root_reps = tuple(
            hooks.buffer.groups[gid].params[0]
            for gid in hooks.root_groups
            if hooks.buffer.buckets[gid].is_distributed and hooks.buffer.groups[gid].params
        )
        self._root_released = bool(self._root_reps)
        if _REGATHER_ENV in os.environ:
            warn_once(
                "fsdp.regather_env",
                f"{_REGATHER_ENV} is no longer read: gathering released weights again "
                "for a backward that reads them outside their unit is off by default; "
                "pass regather_saved_weights=True when wrapping to turn it on",
            )

    # ---- 1. saved weights: refused by default, gathered again under the opt-in -------
    def hide(self, unit: FSDPUnit) -> None:
        """The unit's weights are released: a version past the saved one on each."""
        if unit.index not in self._shown:
            return
        self._shown.discard(unit.index)
        hidden = self._hidden
        params = tuple(p for p in self._weights[unit.index] if id(p) not in hidden)
        if params:
            versions = tuple(p._version for p in params)
            hidden.update(zip(map(id, params), versions, strict=True))
            _set_versions(params, tuple(v + 1 for v in versions))

    def show(self, unit: FSDPUnit) -> None:
        """The unit's weights are gathered: back to the versions autograd saved."""
        if unit.index in self._shown:
            return
        self._shown.add(unit.index)
        hidden = self._hidden
        params = tuple(p for p in self._weights[unit.index] if id(p) in hidden)
        if params:
            _set_versions(params, tuple(hidden.pop(id(p)) for p in params))

    def hide_all(self) -> None:
        for unit in [self._hooks.units[i] for i in self._shown]:
            self.hide(unit)

    def saved_weights_hooks(self) -> contextlib.AbstractContextManager:
        """Around the whole forward under ``regather_saved_weights=True``: a unit's
        weight that autograd saves for backward is packed as a reference, and
        unpacking it gathers its bucket if it is released; a custom Function's
        backward gets a ``SavedParameter`` sharing the parameter's attributes
        (``saved_weights``: autograd would hand it a copy without them). Otherwise
        nothing (Note [released weights read later])."""
        if not (self.regather_saved_weights and self._released_by_id):
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack_saved, self._unpack_saved)

    def _pack_saved(self, tensor: torch.Tensor) -> Any:
        entry = self._released_by_id.get(id(tensor))
        return tensor if entry is None else _SavedWeight(tensor, entry[0])

    def _unpack_saved(self, packed: Any) -> torch.Tensor:
        if type(packed) is not _SavedWeight:
            # Any other parameter (root buckets, other models) too: hooks in force at
            # save time cost it its attributes otherwise.
            return unpacked_for_python(packed) if type(packed) is nn.Parameter else packed
        gid = packed.gid
        hooks = self._hooks
        if hooks.buffer.buckets[gid].status is not BucketStatus.READY_TO_USE:
            # Every rank runs the same graph, so every rank gathers here; the end of
            # backward (queued now if no hook of this backward did) releases it.
            hooks.begin_backward()
            hooks.gather.gather_for_immediate_use(gid)
        return unpacked_for_python(packed.weight)

    def check_side_path(self, param: nn.Parameter) -> None:
        """A gradient for a unit's weight while the unit is not in backward (its forward
        ran, no gradient reached its outputs yet): it came through a path that bypasses
        the unit's outputs and read the weight while it was released, not through a
        saved tensor (autograd refuses those, ``hide``). Every rank runs the same
        graph: all raise, before the gradient is accumulated."""
        entry = self._released_by_id.get(id(param))
        if entry is None:
            return
        unit = entry[1]
        if unit.state is TrainingState.IDLE:  # no pre-backward of its group reached it
            name = self._hooks.param_names[param]
            raise RuntimeError(
                f"fsdp: the gradient of {name!r} (FSDP unit {unit.name!r}) was computed by a "
                "backward that reached the weight without going through the unit's outputs "
                "(e.g. an auxiliary loss kept on the module, backpropagated on its own), "
                "while ZeRO-3 had released the unit's weights: it read freed memory. Add that "
                "loss to the main loss before one backward, or pass "
                "regather_saved_weights=True when wrapping, to gather such weights when "
                "backward reads them"
            )

    # ---- 2. outputs that view a unit's weights ---------------------------------------
    def copy_out_views(self, unit: FSDPUnit, output: Any) -> Any:
        """``output`` with every tensor that views one of the unit's buckets (a slice or
        expand of its parameter) replaced by a copy: the buckets are released next, and
        the view would read freed memory, or another unit's weights in a double-buffer
        slot. The copy is differentiable (the gradient reaches the parameter)."""
        return _copy_views(self._bucket_reps[unit.index], output)

    def copy_out_root_views(self, output: Any) -> Any:
        """The same for the model's output and the root buckets, released at the end of
        the step (a root-level ``self.pe[:T]`` returned from an eval forward, or kept
        past the backward)."""
        return _copy_views(self._root_reps, output)

    # ---- 3. graphs built by a backward -----------------------------------------------
    def check_double_backward(self, unit: FSDPUnit | None) -> None:
        """At a pre-backward (``unit``, or the root's when None): a backward with
        ``create_graph=True`` (grad mode on inside it) builds a graph that saves the
        weights it reads, without any hook of ours, and ZeRO-3 releases them before a
        second backward through that graph could read them. Every rank runs the same
        graph: all raise, before anything is gathered."""
        if not torch.is_grad_enabled():
            return
        if unit is not None:
            if not self._weights[unit.index]:
                return
            where = f"FSDP unit {unit.name!r}"
        else:
            if not (self._units_released or self._root_released):
                return
            names = self._units_released
            where = (
                f"FSDP units {', '.join(map(repr, names[:4]))}{', ...' if len(names) > 4 else ''}"
                if names
                else "the model's parameters"
            )
        raise RuntimeError(
            f"fsdp: a backward with create_graph=True (a double backward: a gradient "
            f"penalty, a Hessian-vector product) reached {where}, whose weights ZeRO-3 "
            "(optim_grads_params) releases after their backward; the graph it builds "
            "would read them after their release, and fsdp does not gather them again "
            "for it (regather_saved_weights covers only tensors saved in forward). Use "
            "zero_dp_strategy=2 (optim_grads: the weights stay gathered) for a model "
            "trained with a double backward"
        )


def _copy_views(reps: tuple[nn.Parameter, ...], output: Any) -> Any:
    """``output`` with every tensor sharing the storage of one of ``reps`` copied (the
    copy is differentiable: the gradient reaches the parameter)."""
    if not reps:
        return output
    keys = {storage_key(p) for p in reps}
    if isinstance(output, torch.Tensor):  # the usual output: no pytree walk
        return output.clone() if storage_key(output) in keys else output
    if not any(storage_key(t) in keys for t in flatten_tensors(output)):
        return output
    return map_tensors(output, lambda t: t.clone() if storage_key(t) in keys else t)
