"""The hooks that decide when buckets are gathered, released and reduced.

Note on one step under ZeRO-3 (see DESIGN.md's data flow):

1. Root pre-forward: the wrapped module's parameters become the compute parameters
   (views into buckets); buckets outside every FSDP unit are gathered and stay
   gathered until the end of backward.
2. Unit pre-forward: gather the unit's buckets, prefetch what follows in forward order,
   and route the unit's inputs through ``RegisterFSDPBackwardFunction`` so that the
   unit's post-backward runs once the gradients of its inputs exist.
3. Unit post-forward: release the unit's buckets, and hook its outputs so that the first
   gradient reaching them runs the unit's pre-backward. While a unit's buckets are
   released its modules hold the DTensor parameters (this rank's shard), as in FSDP2:
   the compute parameters are views into freed storage, and reading one would read
   freed memory (a crash, not an error). Its pre-forward and pre-backward swap the
   compute parameters back; autograd itself never looks them up by attribute.
4. Unit pre-backward: gather again and prefetch in backward order. The first backward
   event of a step also queues the end-of-backward callback on the outer graph task.
5. Gradients stay on the compute parameters' ``.grad`` (``GradStaging.AUTOGRAD``), or
   post-accumulate-grad hooks add each into its bucket's ``main_grad`` staging
   (``MAIN_GRAD``); the hooks also record which parameters a gradient reached.
6. Unit post-backward (each call): mark its trainable buckets ready for the
   ``GradReducePipeline``, which reduces them in its fixed order (see "When reductions
   start" below) from what arrived since their last reduction; then release them.
7. End of backward: launch what is left (parameters without gradients reduce zeros),
   agree across ranks on the buckets holding gradients that came after their reduction
   and reduce those again, wait for every reduction, release everything, check for
   NaN/Inf when asked, and swap the DTensor parameters back in with their ``.grad`` on
   the main-grad shards.

Activation recompute: a unit's forward that runs inside backward (torch.utils.checkpoint
recomputing it, reentrant or not) is not a new forward. ``TrainingState`` tells: a unit
forward that starts while the root is in PRE_BACKWARD (a backward of this model is
under way) is a recompute. Its pre-forward finds the buckets already gathered by the
unit's pre-backward (or, when the unit itself was checkpointed reentrantly, its first
forward ran under no_grad and no pre-backward was registered: gathers them itself),
prefetches in backward order and puts the unit in PRE_BACKWARD; its post-forward, seeing
PRE_BACKWARD, keeps them for the backward that follows, so a recomputed unit is gathered
once for both. The engine's own "is a backward running" query is asked in two places
only: at a unit's pre-forward when the root is not in PRE_BACKWARD (a forward run by a
backward that reached no unit's outputs, ``UnitGroup.side_recompute``), and to tell a backward
that raised (its end-of-backward callback never ran, the root is left in PRE_BACKWARD)
from one still under way (``recover_if_backward_aborted``).

When reductions start. A bucket's reduction is launched only at points that every rank
reaches in the same order, so that reductions and the gathers of ZeRO-3's backward are
issued in one order on every rank (they share the shard group): each post-backward of a
unit marks the buckets it releases ready, and the end of backward launches the rest
(root buckets, buckets of units without hooks or whose post-backward did not run), in
the pipeline's fixed order. With ``overlap_grad_reduce=False`` no unit marks its
buckets: all wait for the end. Marking a bucket when its last gradient arrived instead
would depend on the rank's data: with a branch taken on one rank only (some parameters
get no gradient there) one rank would launch a reduce-scatter while the other issues
the next all-gather, and both wait forever. The autograd engine runs a ready
AccumulateGrad node before any other ready node, so a unit's gradients have arrived when
its post-backward runs; those that come later (a weight also used outside the unit) are
found at the end of backward, where one agreement makes every rank reduce them.

Units called more than once in a forward (shared weights: ``block(block(h))``, or one
module at two positions of a ``ModuleList``, or two forwards before one backward): each
call has its own pre-forward, post-forward, pre-backward and post-backward, so under
ZeRO-3 the unit is gathered and released once per call, and its buckets are reduced at
each call's post-backward, as FSDP2 does: reduction is linear, so the reductions of what
arrived between them add up to the whole gradient (a gradient that autograd adds over
both calls arrives once, and the other call reduces zeros).

Coalesced units (``suggested_communication_unit_size``) share buckets: the hooks of
each unit call its ``UnitGroup``, which owns the gathers, releases and reductions of the
communication unit as one (Note [unit groups] in ``unit_group``).

A unit that is entirely ``fsdp_no_shard`` gets no gathering hooks (seed 002: nothing
to gather, and no per-module dispatch for a frozen encoder's many layers): two forward
hooks on the unit keep its ``TrainingState`` true (plus the backward pair when it has
trainable parameters), and its buckets are reduced at the end of backward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_buffers import (
    AllGatherPipeline,
    GradReducePipeline,
    GradStaging,
    ParamAndGradBuffer,
    annotate,
    module_is_fully_no_shard,
)
from fsdp_hooks.runtime.backward import (
    in_backward,
    queue_end_of_backward_callback,
    register_pre_backward,
    wrap_inputs_for_post_backward,
)
from fsdp_hooks.runtime.config import RuntimeCallbacks, RuntimeConfig
from fsdp_hooks.runtime.param_state import ParamState
from fsdp_hooks.runtime.param_swap import ParamSwapping, SavedWeightHooks, plan_swaps
from fsdp_hooks.runtime.schedule_check import Phase, ScheduleCheck, schedule_check_requested
from fsdp_hooks.runtime.training_state import TrainingState
from fsdp_hooks.runtime.unit import FSDPUnit
from fsdp_hooks.runtime.unit_group import UnitGroup, group_units
from fsdp_mesh.device import control_device

__all__ = ["FSDPHooks", "FSDPUnit", "raise_if_nonfinite_on_any_rank"]


def raise_if_nonfinite_on_any_rank(
    checked: list[tuple[str, torch.Tensor]], group: Any, device: torch.device, option: str
) -> None:
    """``checked``: (parameter name, "its local gradient is finite" as a 0-d tensor, kept
    unread so that checking cost no device sync per gradient). Agree across ``group``
    whether any rank saw a NaN/Inf; if one did, raise on every rank naming the
    parameters and the ranks. Empties ``checked``."""
    # One device-to-host read for the whole check (the all-reduce's), not one per gradient.
    finite = [f.to(device) for _name, f in checked]
    if finite:
        flag = torch.logical_not(torch.stack(finite).all()).to(torch.float32).reshape(1)
    else:
        flag = torch.zeros(1, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item() == 0:
        checked.clear()
        return
    bad = sorted({name for name, f in checked if not bool(f)})  # only now: someone failed
    checked.clear()
    reports: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, (dist.get_rank(), bad), group=group)
    lines = [f"rank {rank}: {names}" for rank, names in reports if names]
    raise RuntimeError(
        f"NaN or Inf found in local gradients ({option}) of parameters:\n" + "\n".join(lines)
    )


def _eager(hook: Any) -> Any:
    """``hook`` with its frame, and every frame it calls, skipped by TorchDynamo, as
    FSDP2 does for its hooks (``_dynamo_disable``). ``unit.compile()`` compiles the
    unit's ``_call_impl``; dynamo leaves that torch frame to Python and compiles the
    frames it calls instead: each module hook as one and ``forward`` as another. Our
    hooks gather, release and hook autograd: Python bookkeeping that dynamo cannot
    trace (it broke each unit's hooks into several graphs). Skipped, they run eagerly
    around the unit's one compiled ``forward`` graph and break nothing."""
    return torch.compiler.disable(hook, recursive=True, reason="fsdp's hooks run eagerly")


class FSDPHooks:
    """All hooks of one ``MegatronFSDP`` and the per-step state they share."""

    def __init__(
        self,
        buffer: ParamAndGradBuffer,
        gather: AllGatherPipeline,
        reduce: GradReducePipeline,
        config: RuntimeConfig,
        callbacks: RuntimeCallbacks,
    ) -> None:
        self.config = config
        self._callbacks = callbacks
        # Whether each gradient is checked for NaN/Inf: read per gradient, so a plain
        # attribute (the wrapper's ``report_nan_in_param_grad`` sets it).
        self.report_nan = config.report_nan
        self.buffer = buffer
        self.gather = gather
        self.reduce = reduce
        self._stages_main_grad = buffer.grad_staging is GradStaging.MAIN_GRAD
        self.root_state = TrainingState.IDLE
        # Root buckets (ParamAndGradBuffer.root_groups: outside every unit, or tied to
        # a module outside every unit): gathered at the root pre-forward and kept until
        # the end of backward, as no unit hook runs around them.
        self.root_groups = buffer.root_groups
        self._callback_queued = False
        # Whether the gradients of the last backward were checked and attached; whether
        # none has arrived since (then those users dropped are forgotten first).
        self.grads_published = False
        self._check_dropped = False
        self._nonfinite: list[tuple[str, torch.Tensor]] = []
        self.param_names = {p: name for name, _g, _i, p in buffer.named_params()}
        # The hooks' profiler ranges, made once (re-entrant; the hooks of one model never
        # run on two threads at once).
        self._range_root_pre_forward = annotate("fsdp.root_pre_forward")
        self._range_root_post_forward = annotate("fsdp.root_post_forward")
        self._range_pre_forward = annotate("fsdp.pre_forward")
        self._range_post_forward = annotate("fsdp.post_forward")
        self._range_pre_backward = annotate("fsdp.pre_backward")
        self._range_end_of_backward = annotate("fsdp.end_of_backward")

        module = config.module
        root = set(self.root_groups)
        self.units: list[FSDPUnit] = []
        hooked: list[FSDPUnit] = []
        for index, name in enumerate(buffer.unit_names):
            unit_module = module.get_submodule(name)
            groups: list[int] = []
            for p in unit_module.parameters():
                gid = buffer.group_of(p)[0]
                if gid not in groups:
                    groups.append(gid)
            unit = FSDPUnit(index, name, unit_module, groups, [g for g in groups if g not in root])
            self.units.append(unit)
            if module_is_fully_no_shard(unit_module):
                # Replicated: nothing to gather or release; hooks that keep its state.
                self._register_state_hooks(unit)
                continue
            unit.hooked = True
            hooked.append(unit)
        self._grad_handles = [
            p.register_post_accumulate_grad_hook(self._on_param_grad)
            for group in buffer.groups
            if group.requires_grad
            for p in group.params
            if p.requires_grad
        ]
        for group in buffer.groups:
            for p in group.params:
                p._fsdp_managed = True  # type: ignore[attr-defined]

        # Every place a parameter is reachable from, so tied weights swap together.
        distributed = dict(buffer.views.distributed_named_parameters())
        by_param = {p: distributed[name] for p, name in self.param_names.items()}
        for dparam in distributed.values():
            dparam._fsdp_model_ref = callbacks.owner  # type: ignore[attr-defined]
        plan = plan_swaps(module, buffer, self.units, by_param)
        # Reads of released unit weights: refused, copied or gathered again (their module).
        self.saved_weights = SavedWeightHooks(self, config.regather_saved_weights)
        self.swap = ParamSwapping(buffer, plan, by_param, self.saved_weights)
        self.params = ParamState(buffer, by_param, config)
        self._reached_add = self.params.reached.add  # per gradient (the set is kept)
        # Opt-in (FSDP_CHECK_SCHEDULE=1): ranks agree on each point that issues collectives.
        self.schedule: ScheduleCheck | None = None
        if schedule_check_requested() and dist.is_initialized():
            device = control_device(buffer.device)
            self.schedule = ScheduleCheck(
                config.dist_index.get_dp_group(), [u.name for u in self.units], device
            )
        # One owner of gathers, releases and reductions per communication unit (Note
        # [unit groups]); each member's hooks call it.
        self.unit_groups: list[UnitGroup] = []
        for members in group_units(buffer, hooked):
            group = UnitGroup(
                members,
                buffer,
                gather,
                reduce,
                self.swap.unit_use,
                self._group_pre_backward,
                overlap_grad_reduce=config.overlap_grad_reduce,
                stages_main_grad=self._stages_main_grad,
            )
            self.unit_groups.append(group)
            for unit in members:
                unit.handles.append(
                    unit.module.register_forward_pre_hook(
                        _eager(functools.partial(self._unit_pre_forward, group, unit)),
                        prepend=True,
                        with_kwargs=True,
                    )
                )
                unit.handles.append(
                    unit.module.register_forward_hook(
                        _eager(functools.partial(self._unit_post_forward, group, unit))
                    )
                )
        # The wrapper's forward calls these: a compiled wrapper then breaks its graph at
        # these calls only, not at each Python step inside them.
        self.root_pre_forward = _eager(self.root_pre_forward)  # type: ignore[method-assign]
        self.root_post_forward = _eager(self.root_post_forward)  # type: ignore[method-assign]

    # ---- root -----------------------------------------------------------------------
    def root_pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        with self._range_root_pre_forward:
            self.recover_if_backward_aborted()
            # A forward inside this model's backward is activation recompute (the whole
            # model checkpointed): not a new step.
            if self.root_state is not TrainingState.PRE_BACKWARD:
                if self.schedule is not None:
                    self.schedule.check(Phase.FORWARD)
                for group in self.unit_groups:
                    group.abandon_pass()  # a forward that raised left it open
                self.params.sync_requires_grad()
                if self.root_state is TrainingState.IDLE and self.params.main_weights_changed():
                    # In-place writes to the main weights since the last install.
                    self._callbacks.install_main_weights()
                self.root_state = TrainingState.FORWARD
            self.swap.use_compute_params()
            self.swap.hold_stale_units()  # ZeRO-1/2 after a step: Note [stale buckets]
            self.gather.all_gather_params(self.root_groups, prefetch=False)
        return args, kwargs

    def root_post_forward(self, output: Any) -> Any:
        # Outputs that view a root bucket are copied: it is released at the step's end.
        output = self.saved_weights.copy_out_root_views(output)
        if self.root_state is TrainingState.PRE_BACKWARD:
            return output  # recompute inside backward: the backward goes on
        with self._range_root_post_forward:
            self.gather.land_stale()  # buckets no unit of this forward used
            for group in self.unit_groups:  # members this forward skipped
                group.finish_skipped(output)
            self.gather.commit_observed_order()
            backward_pending = torch.is_grad_enabled() and register_pre_backward(
                output, self._root_pre_backward
            )
            if not backward_pending:
                # No backward will follow (eval, no_grad): nothing to keep gathered.
                self._release_all()
                self.swap.use_distributed_params()
            self.root_state = TrainingState.IDLE
        return output

    def _root_pre_backward(self) -> None:
        """The first gradient of a backward reached the output of a root forward."""
        self.saved_weights.check_double_backward(None)
        self.begin_backward()
        self.root_state = TrainingState.PRE_BACKWARD
        if not self.swap.using_compute:
            # Another graph's end of backward, or a forward without backward (eval
            # under no_grad), ran since this graph's forward and released everything:
            # back to the state this forward ended in (units' buckets are gathered by
            # their own pre-backward; the root buckets again here).
            self.swap.use_compute_params()
            for unit in self.units:
                self.swap.unit_use(unit, compute=False)
            self.gather.all_gather_params(self.root_groups, prefetch=False)
        for gid in self.root_groups:  # param.main_grad exists before any gradient
            self.reduce.prepare(gid)

    def begin_backward(self) -> None:
        if not self._callback_queued:
            if self._check_dropped:
                self._forget_dropped_grads()
            self._callback_queued = True
            self.grads_published = False
            self.reduce.sync_grads = self._callbacks.sync_grads()
            queue_end_of_backward_callback(self._end_of_backward)

    # ---- units ----------------------------------------------------------------------
    def _register_state_hooks(self, unit: FSDPUnit) -> None:
        """Hooks of a unit that is entirely ``fsdp_no_shard``: its ``TrainingState`` and
        nothing else (no gather, release or bucket lookup). Backward states only when
        a gradient can flow through it."""
        trainable = any(p.requires_grad for p in unit.module.parameters())

        def post_backward() -> None:
            unit.state = TrainingState.POST_BACKWARD

        def pre_backward() -> None:
            unit.state = TrainingState.PRE_BACKWARD

        def pre_forward(module: nn.Module, args: tuple, kwargs: dict):
            if self.root_state is TrainingState.PRE_BACKWARD:  # recompute
                unit.state = TrainingState.PRE_BACKWARD
                return args, kwargs
            unit.state = TrainingState.FORWARD
            if trainable and torch.is_grad_enabled():
                return wrap_inputs_for_post_backward(post_backward, args, kwargs)
            return args, kwargs

        def post_forward(module: nn.Module, args: tuple, output: Any) -> Any:
            if unit.state is not TrainingState.PRE_BACKWARD:
                unit.state = TrainingState.IDLE
                if trainable and torch.is_grad_enabled():
                    register_pre_backward(output, pre_backward)
            return output

        unit.handles.append(
            unit.module.register_forward_pre_hook(
                _eager(pre_forward), prepend=True, with_kwargs=True
            )
        )
        unit.handles.append(unit.module.register_forward_hook(_eager(post_forward)))

    def _unit_pre_forward(
        self, group: UnitGroup, unit: FSDPUnit, module: nn.Module, args: tuple, kwargs: dict
    ):
        with self._range_pre_forward:
            # A forward inside this model's backward is a recompute (activation
            # checkpointing): the unit is in PRE_BACKWARD even when no pre-backward hook
            # of its own fired (a reentrant checkpoint ran its forward under no_grad).
            recompute = self.root_state is TrainingState.PRE_BACKWARD
            if not recompute and torch._C._current_graph_task_id() != -1:  # in_backward()
                self.begin_backward()
                group.side_recompute(unit)
                return args, kwargs
            if not recompute and self.schedule is not None:
                self.schedule.check(Phase.UNIT_FORWARD, unit.index)
            return group.pre_forward(unit, recompute, args, kwargs)

    def _unit_post_forward(
        self, group: UnitGroup, unit: FSDPUnit, module: nn.Module, args: tuple, output: Any
    ):
        # Outputs that view the unit's buckets are copied before any release (recompute
        # too: the same ops as the first forward).
        output = self.saved_weights.copy_out_views(unit, output)
        with self._range_post_forward:
            group.post_forward(unit, output)
        return output

    def _group_pre_backward(self, group: UnitGroup, unit: FSDPUnit | None, last: bool) -> None:
        with self._range_pre_backward:
            if unit is not None:  # else nothing is gathered: the members' outputs do it
                if self.schedule is not None:
                    self.schedule.check(Phase.UNIT_BACKWARD, unit.index)
                self.saved_weights.check_double_backward(unit)
            self.begin_backward()
            self.root_state = TrainingState.PRE_BACKWARD
            group.pre_backward(unit, last)

    # ---- gradients ------------------------------------------------------------------
    def _forget_dropped_grads(self) -> None:
        """Before the first gradient after the last published ones (a backward's first
        event, or a gradient of a backward that meets no unit hook): gradients users
        dropped since start afresh (``DTensorViews.forget_dropped_grads``)."""
        self._check_dropped = False
        self.buffer.views.forget_dropped_grads(self.params.unreached)

    def _on_param_grad(self, param: torch.Tensor) -> None:
        if self._check_dropped:
            self._forget_dropped_grads()
        saved = self.saved_weights
        if not saved.regather_saved_weights:  # else there is nothing to check (the default)
            saved.check_side_path(param)  # type: ignore[arg-type]
        self._reached_add(id(param))  # ParamState.reached
        if self.report_nan and param.grad is not None:
            grad = param.grad
            local = grad.to_local() if isinstance(grad, DTensor) else grad  # tp: no collective
            # Kept as a tensor: checking now would sync the device once per parameter.
            self._nonfinite.append((self.param_names[param], torch.isfinite(local).all()))
        if self._stages_main_grad:  # else it stays on .grad (Note [gradient staging])
            self.reduce.accumulate(param)  # type: ignore[arg-type]

    def _end_of_backward(self) -> None:
        with self._range_end_of_backward:
            self.root_state = TrainingState.POST_BACKWARD
            try:
                if self.schedule is not None:
                    self.schedule.check(Phase.END_OF_BACKWARD)
                self.reduce.finish(agree=self.params.agree)
                if self.reduce.sync_grads:
                    self.raise_if_nonfinite_grads()
            finally:
                self._reset_after_backward()
                # As in Megatron-FSDP, .grad appears only once every gradient is
                # reduced: after a backward that synced, else at finish_grad_sync().
                if self.reduce.sync_grads:
                    self.attach_grads(only_with_grads=False)
                    self.params.run_grad_hooks()
                self._callbacks.backward_ended()
                self._callback_queued = False
                self.root_state = TrainingState.IDLE

    def recover_if_backward_aborted(self) -> bool:
        """Reset the per-step state when the last backward raised (an OOM-skipped batch,
        Ctrl-C): the engine never ran its end-of-backward callback, so its flag, the
        gathered buckets, the launched reductions, the compute parameters and the units'
        states are as the exception left them. Runs at the next forward and at
        ``zero_grad_buffer``; True when it reset."""
        if not self._callback_queued or in_backward():
            return False
        self.reduce.abort()
        self._reset_after_backward()
        self._nonfinite.clear()
        self._callback_queued = False
        self.root_state = TrainingState.IDLE
        return True

    def _reset_after_backward(self) -> None:
        """A backward ended (or was abandoned): nothing gathered, no pass under way, every
        unit idle, the DTensor parameters in place."""
        self._release_all()
        for unit in self.units:
            unit.state = TrainingState.IDLE
        self.swap.use_distributed_params()

    def _release_all(self) -> None:
        for group in self.unit_groups:
            group.reset()
        self.gather.reset()

    def attach_grads(self, only_with_grads: bool) -> None:
        self.buffer.views.attach_grads(only_with_grads=only_with_grads)
        self.buffer.views.drop_grads(self.params.unreached)  # None where no backward reached
        self.grads_published = True
        self._check_dropped = True

    def publish_grads(self) -> None:
        """``finish_grad_sync``: reduce what is still unreduced; when that reduced
        anything, or the last backward did not publish its gradients (it ran without
        sync), check them for NaN/Inf and attach them. Once per step: after a backward
        that synced, both already ran at its end."""
        reduced = self.reduce.reduce_accumulated()
        if reduced or not self.grads_published:
            self.raise_if_nonfinite_grads()
            self.attach_grads(only_with_grads=True)
            self.params.run_grad_hooks()

    def clear_nonfinite_grads(self) -> None:
        self._nonfinite.clear()
        self.params.clear()

    def raise_if_nonfinite_grads(self) -> None:
        """With ``check_for_nan_in_grad``/``report_nan_in_param_grad``: agree across
        the data-parallel group whether any rank saw a NaN/Inf gradient, and if so
        raise on every rank, naming the parameters and the ranks."""
        if not self.report_nan:
            return
        raise_if_nonfinite_on_any_rank(
            self._nonfinite,
            self.config.dist_index.get_dp_group(),
            control_device(self.buffer.device),
            "report_nan_in_param_grad / check_for_nan_in_grad",
        )
