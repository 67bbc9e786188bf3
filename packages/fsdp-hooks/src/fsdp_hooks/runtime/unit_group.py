"""``UnitGroup``: the FSDP units of one communication unit and the hooks that gather,
release and reduce their buckets (FSDP2's ``FSDPParamGroup``).

Note [unit groups]
~~~~~~~~~~~~~~~~~~
Unit coalescing (``suggested_communication_unit_size``; Note [communication units] in
``fsdp_buffers.param_group``) joins consecutive FSDP units into one communication unit
whose buckets they share; without it each unit is a group of its own. The grouping is
fixed at wrap time, as FSDP2's ``fully_shard([a, b])``: one ``UnitGroup`` owns gather,
release, pre-backward and post-backward for its members' buckets, so nothing at run time
counts who still needs a shared bucket.

- Forward: a pass of the group starts at the pre-forward of the member that runs first
  (it gathers, prefetches, and routes that member's inputs through
  ``RegisterFSDPBackwardFunction``) and ends at the post-forward of the last member to
  run, which releases the buckets. Each member's post-forward hooks its output for that
  member's pre-backward. A member run again within the pass changes nothing else;
  members the forward skipped are finished at the root post-forward (FSDP2's
  ``_force_complete_incomplete_states``).
- Backward: each member's pre-backward (the first gradient at its output: a backward
  from a loss on an inner member's output reaches no later one) gathers that member's
  buckets (a frozen member's output needs no gradient: its bucket stays released); the
  post-backward (the gradients of the first member's inputs, so after every member's
  backward) marks the buckets ready and releases them.
- Activation recompute inside backward gathers as a pre-forward does, and routes the
  inputs of the member that ran first in forward through the post-backward (once until
  the group's next post-backward): a reentrant checkpoint ran the forward under
  ``no_grad``, so only its recompute can hook them. A checkpoint around the whole
  group recomputes every member before their backward; a reentrant checkpoint per
  member recomputes and backpropagates member by member, last member first: either
  way the post-backward comes after every member's backward, once.

What a post-backward did not see (a weight also used outside its unit, a member's
backward after the group's post-backward) is reduced at the end of backward
(``GradReducePipeline.finish``): the grouping decides when memory is freed and
reductions start, never what is reduced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from fsdp_buffers import (
    AllGatherPipeline,
    GradReducePipeline,
    ParamAndGradBuffer,
    PrefetchOrder,
    annotate,
)
from fsdp_hooks.runtime.backward import register_pre_backward, wrap_inputs_for_post_backward
from fsdp_hooks.runtime.training_state import TrainingState
from fsdp_hooks.runtime.unit import FSDPUnit

__all__ = ["UnitGroup", "group_units"]


def group_units(buffer: ParamAndGradBuffer, units: list[FSDPUnit]) -> list[list[FSDPUnit]]:
    """The hooked units grouped by communication unit (the units whose buckets they
    release), in registration order."""
    by_comm: dict[tuple[int, ...], list[FSDPUnit]] = {}
    for unit in units:
        comm = next(
            (
                buffer.groups[g].coalesced_unit_ids
                for g in unit.release_groups
                if unit.index in buffer.groups[g].coalesced_unit_ids
            ),
            (unit.index,),
        )
        by_comm.setdefault(tuple(comm), []).append(unit)
    return list(by_comm.values())


class UnitGroup:
    """One communication unit's members and the state of its passes (Note [unit
    groups]). ``use_params(unit, compute)`` puts a member's compute parameters (or its
    DTensors) in its modules (``ParamSwapping``); ``on_pre_backward(group, unit, last)``
    is the root's pre-backward of a member, registered on its output (``last``: the
    pass's last output; ``unit`` None: the model's output, for a pass some members
    skipped), bound once here for each case."""

    def __init__(
        self,
        members: list[FSDPUnit],
        buffer: ParamAndGradBuffer,
        gather: AllGatherPipeline,
        reduce: GradReducePipeline,
        use_params: Callable[[FSDPUnit, bool], None],
        on_pre_backward: Callable[[UnitGroup, FSDPUnit | None, bool], None],
        *,
        overlap_grad_reduce: bool,
        stages_main_grad: bool,
    ) -> None:
        self.members = members
        self.release_groups = list(dict.fromkeys(g for u in members for g in u.release_groups))
        # Marked ready at the post-backward; the others wait for the end of backward, as
        # all do without overlap_grad_reduce.
        self.marks = frozenset(
            g for g in self.release_groups if overlap_grad_reduce and buffer.groups[g].requires_grad
        )
        self.gather = gather
        self.reduce = reduce
        self._use = use_params
        self._stages_main_grad = stages_main_grad
        # The root's pre-backward, per (member, last output of its pass), made once here
        # rather than per forward call; and for the model's output (a pass cut short).
        self._pre_backward = {
            (unit, last): functools.partial(on_pre_backward, self, unit, last)
            for unit in members
            for last in (False, True)
        }
        self._skipped_pre_backward = functools.partial(on_pre_backward, self, None, True)
        # Members yet to run in the forward pass under way (empty: no pass under way).
        self._to_run: set[FSDPUnit] = set()
        # The member that started the last forward pass; whether a recompute of it hooked
        # its inputs for a post-backward that has not run yet.
        self._first: FSDPUnit | None = None
        self._recompute_hooked = False
        # Passes of this backward whose last output's pre-backward ran and whose
        # post-backward has not (MAIN_GRAD: a second pass's pre-backward may come first
        # and needs its staging kept).
        self._open_backwards = 0
        self._range_post_backward = annotate("fsdp.post_backward")  # made once, re-entrant

    # ---- forward --------------------------------------------------------------------
    def pre_forward(self, unit: FSDPUnit, recompute: bool, args: tuple, kwargs: dict):
        if recompute:
            self._set_state(TrainingState.PRE_BACKWARD)
            order = PrefetchOrder.BACKWARD_PASS_ORDER
            hook_inputs = not self._recompute_hooked and self._first in (None, unit)
            self._recompute_hooked |= hook_inputs
        else:
            unit.state = TrainingState.FORWARD
            order = PrefetchOrder.FORWARD_PASS_ORDER
            hook_inputs = not self._to_run
            if hook_inputs:
                self._to_run.update(self.members)
                self._first = unit
        self.gather.all_gather_params(unit.groups, prefetch=True, prefetch_order=order)
        self._use(unit, True)
        if hook_inputs and torch.is_grad_enabled():
            # (A reentrant checkpoint's first forward runs under no_grad: its recompute
            # hooks the inputs instead.)
            args, kwargs = wrap_inputs_for_post_backward(self.post_backward, args, kwargs)
        return args, kwargs

    def post_forward(self, unit: FSDPUnit, output: Any) -> None:
        if unit.state is TrainingState.PRE_BACKWARD:
            return  # recompute: the backward that follows needs the buckets
        self._use(unit, False)
        unit.state = TrainingState.IDLE
        last = unit in self._to_run and len(self._to_run) == 1
        self._to_run.discard(unit)
        if last:
            self._release()
        if torch.is_grad_enabled():
            # Autograd on, yet no output needs a gradient (a frozen unit): no backward
            # will gather its buckets, so none should prefetch them. (Under no_grad, a
            # reentrant checkpoint's first forward, its recompute will.)
            hook = self._pre_backward[unit, last]
            self.gather.record_backward(unit.release_groups, register_pre_backward(output, hook))

    def finish_skipped(self, output: Any) -> None:
        """Root post-forward: end a pass some members did not run; ``output`` (the
        model's) counts as its last output."""
        if self._to_run:
            self._to_run.clear()
            self._release()
            if torch.is_grad_enabled():
                register_pre_backward(output, self._skipped_pre_backward)

    def abandon_pass(self) -> None:
        """Root pre-forward of a new step: a pass the last forward left open (it raised
        before the root post-forward) is over."""
        if self._to_run:
            self._to_run.clear()
            self._release()

    def _release(self) -> None:
        for gid in self.release_groups:
            self.gather.release_bucket(gid)

    def side_recompute(self, unit: FSDPUnit) -> None:
        """A member's forward run by a backward that reached no unit's outputs (an aux
        loss backpropagated on its own, whose saved tensors a checkpoint recomputes):
        no pre- or post-backward will come. Gather for immediate use, as an unpacked
        saved weight is, kept until the end of that backward; the member stays in
        PRE_BACKWARD so that its post-forward releases nothing."""
        unit.state = TrainingState.PRE_BACKWARD
        for gid in unit.groups:
            self.gather.gather_for_immediate_use(gid)
        self._use(unit, True)

    # ---- backward -------------------------------------------------------------------
    def pre_backward(self, unit: FSDPUnit | None, last: bool) -> None:
        """The first gradient reached ``unit``'s output (None: the model's, for a pass
        some members skipped; their own outputs gather)."""
        self._open_backwards += last
        if unit is None:
            return
        unit.state = TrainingState.PRE_BACKWARD
        self.gather.all_gather_params(
            unit.groups, prefetch=True, prefetch_order=PrefetchOrder.BACKWARD_PASS_ORDER
        )
        self._use(unit, True)
        for gid in unit.groups:
            self.reduce.prepare(gid)

    def post_backward(self) -> None:
        with self._range_post_backward:
            self._set_state(TrainingState.POST_BACKWARD)
            self._recompute_hooked = False
            self._open_backwards = max(0, self._open_backwards - 1)
            for gid in self.release_groups:
                if gid in self.marks:
                    # Every pass: what arrived since the last reduction (Note [gradient
                    # staging]); later gradients are reduced at the end of backward.
                    self.reduce.mark_bucket_ready(gid)
                    if self._open_backwards and self._stages_main_grad:
                        self.reduce.prepare(gid)  # another pass's main_grad writes come
            self._release()
            for unit in self.members:
                self._use(unit, False)

    def reset(self) -> None:
        """End of a backward, or a forward no backward follows: no pass under way."""
        self._to_run.clear()
        self._first = None
        self._recompute_hooked = False
        self._open_backwards = 0
        self._set_state(TrainingState.IDLE)

    def _set_state(self, state: TrainingState) -> None:
        for unit in self.members:
            unit.state = state
