"""``GradReducePipeline``: reduce buckets in one fixed order, as they become ready.

Buckets are reduced in one fixed order on every rank (the reverse of forward order,
which is the order backward usually completes them): a bucket marked ready is launched
once every bucket before it in that order has been launched. This keeps collectives
matched across ranks even when ranks complete buckets in different orders, or some
parameters get no gradient on some ranks (``finish`` launches whatever is left, with
zeros standing in for missing gradients). At most ``max_inflight`` reductions are in
flight; launching one more first waits for the oldest. The default, 1, is FSDP2's: each
reduction in flight holds its bucket's unsharded gradients (and, on gloo, the copy the
collective makes of them), and a second one in flight measured 49 MB (about 4 unit
buckets) more peak tensor memory on the 49M GPT under ZeRO-3 at the same step time
(docs/benchmarks.md, "one reduction in flight").

A bucket is marked ready whole (``mark_bucket_ready``: the hook layer does it at each
post-backward of a unit). A bucket reduced already in this backward and marked again (a
unit called twice) is reduced again at once: it reduces what arrived since, and the
sum is exact, reduction being linear (Note [gradient staging] in ``bucket_grads``).
Marks are points every rank reaches in the same order, so both rules keep collectives
matched. ``mark_param_grad_ready`` is the per-parameter route for loops without that
layer (``register_grad_hooks``): it marks a bucket ready once every one of its trainable
parameters reported.

Gradients that arrive after their bucket's last reduction of a backward (a weight also
used outside its unit, a path the unit hooks did not see) are reduced by ``finish``:
each rank says which buckets hold such gradients, ``agree`` (the hook layer's one
agreement at the end of backward) makes the answer the same on every rank, and those
buckets are reduced once more. Without ``agree`` such a gradient raises instead.

Hybrid sharding: the reduction across the outer dim (``reduce_outer``) runs at the end
of a backward that syncs (``sync_grads``), else once per optimizer step from
``reduce_accumulated`` (which ``finish_grad_sync`` calls); see Note [hybrid sharding]
in ``hybrid_sharding``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fsdp_buffers.bucket import GradState
from fsdp_buffers.collectives import PendingCollective, StreamKind, describe_bucket
from fsdp_buffers.param_and_grad_buffer import ParamAndGradBuffer
from fsdp_buffers.profiling import annotate

__all__ = ["GradReducePipeline"]


class GradReducePipeline:
    def __init__(
        self,
        buffer: ParamAndGradBuffer,
        *,
        max_inflight: int = 1,
        reduce_order: Sequence[int] | None = None,
    ) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1; got {max_inflight}")
        self.buffer = buffer
        self.buckets = buffer.buckets
        self.max_inflight = max_inflight
        trainable = [b.gid for b in self.buckets if b.group.requires_grad]
        order = list(reversed(trainable)) if reduce_order is None else list(reduce_order)
        if sorted(order) != trainable:
            raise ValueError(
                f"reduce_order must list each trainable bucket once ({trainable}); got {order}"
            )
        self.reduce_order = order
        self._expected = {
            g: {i for i, p in enumerate(self.buckets[g].group.params) if p.requires_grad}
            for g in trainable
        }
        # When False, buckets with replicated grads only accumulate (no_sync); sharded
        # grads are always reduced, as in Megatron-FSDP.
        self.sync_grads = True
        # (bucket, what it is for errors, the reduction)
        self._inflight: deque[tuple[int, str, PendingCollective]] = deque()
        self._what = {g: describe_bucket(buffer, g, "gradient reduction") for g in trainable}
        self._range_finish = annotate("fsdp.finish_grad_sync")  # made once, re-entrant
        self._begin_backward()

    def _begin_backward(self) -> None:
        self._reported: dict[int, set[int]] = {}  # per-parameter route only
        self._ready: set[int] = set()
        self._next = 0
        self._launched: set[int] = set()
        # MAIN_GRAD staging: buckets that took a gradient since their reduction.
        self._late: set[int] = set()

    def prepare(self, gid: int) -> None:
        """Make bucket ``gid``'s gradient storage exist now where ``param.main_grad``
        views are kept (``MAIN_GRAD`` staging), so that they are valid before any
        gradient arrives (frameworks that accumulate into ``main_grad`` themselves,
        e.g. Transformer Engine's fused wgrad)."""
        if gid in self._expected:
            grads = self.buckets[gid].grads
            if grads.stages_main_grad and grads.reduction_holds_storage:
                self._wait_reduction_of(gid)
                self._note_write(gid)
            grads.prepare_grads()

    def accumulate(self, param: nn.Parameter) -> None:
        """Take ``param``'s gradient into its bucket (``MAIN_GRAD`` staging; under
        ``AUTOGRAD`` it stays on ``.grad`` until the bucket is reduced)."""
        gid, i = self.buffer.group_of(param)
        grads = self.buckets[gid].grads
        if gid in self._launched:
            self._late.add(gid)  # reduced by a later mark of it, else by finish()
            if grads.stages_main_grad and grads.reduction_holds_storage:
                self._wait_reduction_of(gid)
                self._note_write(gid)
        grads.accumulate(i, param)

    def mark_bucket_ready(self, gid: int) -> None:
        """Every gradient of bucket ``gid`` for now is in (missing ones count as zeros):
        launch it, and whatever it held back, in the fixed order; a bucket launched
        before in this backward is launched again at once."""
        if gid in self._launched:
            self._launch(gid)
            return
        self._ready.add(gid)
        self._launch_in_order()

    def mark_param_grad_ready(self, param: nn.Parameter) -> None:
        """Report ``param``'s gradient; mark the bucket ready once every trainable
        parameter of it has reported. Under ``MAIN_GRAD`` staging the gradient is added
        into the staging bucket now; under ``AUTOGRAD`` staging it stays on ``.grad``
        until the bucket is packed for its reduction."""
        self.accumulate(param)
        gid, i = self.buffer.group_of(param)
        reported = self._reported.setdefault(gid, set())
        reported.add(i)
        if reported >= self._expected[gid] and gid not in self._ready:
            self.mark_bucket_ready(gid)

    def _launch_in_order(self) -> None:
        order = self.reduce_order
        while self._next < len(order) and order[self._next] in self._ready:
            self._launch(order[self._next])
            self._next += 1

    def _launch(self, gid: int) -> None:
        self._launched.add(gid)
        self._late.discard(gid)
        bucket = self.buckets[gid]
        if not self.sync_grads and not bucket.sharding.grads:
            bucket.grads.stage_locally()  # accumulate only; reduce at the next sync
            return
        if bucket.grads.reduction_holds_storage:
            self._wait_reduction_of(gid)
        self._wait_for_room()
        self._inflight.append((gid, self._what[gid], bucket.grads.start_reduce()))

    def finish(self, agree: Callable[[list[bool]], list[bool]] | None = None) -> None:
        """End of backward: launch every bucket not launched yet (zeros stand in for
        gradients that never came), then, once more, every bucket that some rank holds
        gradients for that came after its reduction (``agree`` makes each rank's list,
        one flag per bucket of ``reduce_order``, the same on every rank); wait for all
        reductions, and start afresh."""
        with self._range_finish:
            self._ready.update(self._expected)
            self._launch_in_order()
            order = self.reduce_order
            late = [g in self._late or self.buckets[g].grads.holds_autograd_grads() for g in order]
            if agree is not None:
                late = agree(late)
            elif any(late):
                self.abort()
                names = [self._what[g] for g, hit in zip(order, late, strict=True) if hit]
                raise RuntimeError(
                    f"gradients arrived after their bucket was reduced ({names}); they would "
                    "be lost. Call finish() only after backward is complete"
                )
            for gid, hit in zip(order, late, strict=True):
                if hit:
                    self._launch(gid)
            self.wait_all()
            if self.sync_grads:
                self.reduce_outer()
            self._begin_backward()

    def abort(self) -> None:
        """After a backward that raised (its ``finish`` never ran): wait for the
        reductions it launched (every rank launched the same ones) and start afresh.
        Gradients already accumulated stay where they are, as ``.grad`` does in plain
        PyTorch, until ``zero_grad_buffer``."""
        self.wait_all()
        self._begin_backward()

    def reduce_accumulated(self) -> bool:
        """Outside backward: reduce, in order, every bucket still holding unreduced
        gradients (left by backwards run with ``sync_grads=False``), and wait. True
        when it reduced anything (the same answer on every rank)."""
        reduced = False
        for gid in self.reduce_order:
            bucket = self.buckets[gid]
            if bucket.grads.state is GradState.ACCUMULATING:
                self._wait_for_room()
                self._inflight.append((gid, self._what[gid], bucket.grads.start_reduce()))
                reduced = True
        self.wait_all()
        return self.reduce_outer() or reduced

    def reduce_outer(self) -> bool:
        """Hybrid sharding: reduce across the outer group, in order, every bucket whose
        shard-reduced gradients have not been yet, and wait; True when there were any."""
        reduced = False
        for gid in self.reduce_order:
            self._wait_for_room()  # before the launch, which allocates its input
            pending = self.buckets[gid].grads.start_outer_reduce()
            if pending is not None:
                self._inflight.append((gid, f"outer {self._what[gid]}", pending))
                reduced = True
        self.wait_all()
        return reduced

    def _wait_reduction_of(self, gid: int) -> None:
        """Wait, in order, until no reduction of bucket ``gid`` is in flight: before its
        gradient storage is made or written again (a gradient after the bucket's
        reduction, a unit's second pass, a second reduction) while a reduction holds it
        (``BucketGradients.reduction_holds_storage``: it reads it in place, or its
        follow-up frees or rewrites it); a gradient added meanwhile would race the
        collective or be dropped with it."""
        while any(g == gid for g, _w, _p in self._inflight):
            self._wait_oldest()

    def _note_write(self, gid: int) -> None:
        """For a ``StreamRecorder``: the compute stream is about to write bucket
        ``gid``'s gradient storage, which its last reduction held."""
        comm = self.buckets[gid].ctx.comm
        comm.note("write", StreamKind.COMPUTE, gid, "gradients", StreamKind.REDUCE)

    def _wait_for_room(self) -> None:
        while len(self._inflight) >= self.max_inflight:
            self._wait_oldest()

    def wait_all(self) -> None:
        while self._inflight:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        # The reduce stream waits on the reduction and runs its follow-up (into the
        # main grads); the compute stream waits on an event recorded after that before
        # the reduction's input and output (allocated on compute) are dropped, and so
        # before it touches those main grads again (Note [streams and frees]).
        gid, what, pending = self._inflight.popleft()
        self.buckets[gid].ctx.comm.wait(pending, what, StreamKind.REDUCE, gid)

    @property
    def inflight(self) -> int:
        return sum(1 for _g, _w, p in self._inflight if not p.done)

    def register_grad_hooks(self) -> list[RemovableHandle]:
        """Post-accumulate-grad hooks that feed every trainable parameter's gradient
        into this pipeline (for training loops that do not use the hook layer)."""
        handles = []
        for bucket in self.buckets:
            if not bucket.group.requires_grad:
                continue
            for p in bucket.group.params:
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        return handles

    def _on_grad(self, param: torch.Tensor) -> None:
        self.mark_param_grad_ready(param)  # type: ignore[arg-type]
