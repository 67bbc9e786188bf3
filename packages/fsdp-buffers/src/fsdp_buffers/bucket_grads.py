"""``BucketGradients``: a ``Bucket``'s gradients (``bucket.grads``): where a backward's
gradients stage, how they are reduced, and how long the reduced ones live.

Note [gradient states]. ``state`` (``GradState``) is what the main-grad storage holds:

    EMPTY --begin_accumulating--> ACCUMULATING --start_reduce (waited)--> SHARD_REDUCED
    SHARD_REDUCED --start_outer_reduce (waited)--> REDUCED       (hybrid sharding only)
    ACCUMULATING --start_reduce (waited)--> REDUCED              (no outer group)
    SHARD_REDUCED / REDUCED --begin_accumulating--> ACCUMULATING (rebased: see below)
    any --zero_grads--> EMPTY

Gradients are scaled just before they are reduced, on the unreduced data
(Megatron-FSDP's rule), by ``grad_scale`` (1/N for a mean over the N data-parallel
ranks). Sharded-grad buckets reduce-scatter what arrived since their last reduction
and add the result into the main-grad shard, so microbatches accumulate in the
main-grad dtype. Replicated-grad buckets (strategies 0 and 1) accumulate local
gradients in the full main-grad buffer and reduce it in place. If such a buffer already
holds reduced values R when a second backward accumulates before the optimizer step, R
is first rebased to the unreduced value that reduces back to R (R/(N·f) on every rank
for all-reduce; R/f on the owning rank and 0 elsewhere for reduce-scatter), so syncing
every microbatch never double-counts. The outer reduction of hybrid sharding is rebased
the same way (Note [hybrid sharding]).

Note [gradient staging]. Where a backward's gradients wait for their reduction is chosen
once, at wrap time (``GradStaging`` in the buffer's frozen ``GradConfig``):

- ``AUTOGRAD`` (the default; FSDP2's): the compute parameters keep autograd's ``.grad``
  (autograd adds within a backward). The reduction packs them: one chunk-cat
  (``torch._chunk_cat``, or the layout's ``staging_targets`` for whole, replicated or
  coarse slots) of every parameter's gradient, zeros for a parameter without one (so
  every rank sends the same collective), into the rank-major reduce-scatter input, and
  drops the ``.grad``s. Replicated gradients (strategies 0 and 1) are added into their
  persistent buffer instead, and reduced there in place. ``param.main_grad`` is kept only
  where gradients are replicated.
- ``MAIN_GRAD`` (frameworks that add into ``param.main_grad`` themselves: Megatron's
  fused wgrad, ``grad_added_to_main_grad``; the Megatron-Core adapters): each gradient is
  added at its post-accumulate-grad hook into a zeroed parameter-major staging bucket
  that ``param.main_grad`` views (``accumulate``), made at the pre-backward
  (``prepare_grads``); the reduction packs it (``pack``) and frees it.

A bucket may be reduced several times in one backward (a unit called twice): reduction
is linear, so each reduction of what arrived since the last one, added into the main
grads, sums to the reduction of the whole. While a reduction holds the gradients'
storage (``reduction_holds_storage``: it reads a staging bucket or the replicated buffer
in place, or its follow-up rewrites the latter), ``GradReducePipeline`` waits for it
before that storage is written again; a packed staging bucket is freed at the launch,
and the next gradients stage in a new one meanwhile, which that follow-up leaves alone.

Note [released gradients]. Sharded main grads (strategies 2 and 3) exist only from a
backward's first reduction of the bucket until the gradients are cleared, as FSDP2's
do: ``zero_grads`` releases the storage (``DataParallelBuffer.release``: the buffer
then reads as zeros, re-made by any reader) instead of zeroing it, and the next
reduction adopts its reduce-scatter output as the new storage (no zeroing, no add); a
second microbatch adds onto it as before. The optimizer's cast copy and hybrid
sharding's fine slice follow. The optimizer's gradient views (``dtensor_views``) are
re-pointed, not rebuilt: parked on zeros while released, at the new storage when it
is attached again. Nothing is freed under a tensor someone holds (a stale ``.grad``
keeps the old storage alive as long as it is held). Gradients an optimizer parameter
still holds as its ``.grad`` (``zero_grad(set_to_none=False)``, or ``model.zero_grad()``
without the optimizer's) are zeroed in place and kept, as torch keeps them.
Replicated gradients (strategies 0 and 1) keep one persistent buffer, as DDP does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_buffers import collectives
from fsdp_buffers.bucket_state import (
    BucketContext,
    CommGroup,
    GradStaging,
    GradState,
    GroupSharding,
)
from fsdp_buffers.collectives import PendingCollective, StreamKind
from fsdp_buffers.data_parallel_buffer import DataParallelBuffer
from fsdp_buffers.hybrid_sharding import OuterSharding
from fsdp_buffers.param_group import ParameterGroup
from fsdp_buffers.profiling import annotate
from fsdp_buffers.tensor_parallel import TensorParallel

__all__ = ["BucketGradients"]


class BucketGradients:
    """A bucket's gradients and their verbs (Note [gradient states]).

    It holds what it reads of its bucket, not the ``Bucket`` (which owns it and keeps
    it as ``bucket.grads``): the bucket's id, its ``ParameterGroup`` (where the main-grad
    buffer lives), the buffer's shared ``BucketContext``, its shard group, its
    ``OuterSharding`` (hybrid sharding), which buffers are sharded, the buffer's
    ``TensorParallel``, the scale applied before each reduction and the dtype of the
    main weights (that of the optimizer's gradients)."""

    def __init__(
        self,
        gid: int,
        group: ParameterGroup,
        ctx: BucketContext,
        *,
        shard: CommGroup,
        outer: OuterSharding | None,
        sharding: GroupSharding,
        tp: TensorParallel,
        grad_scale: float,
        main_dtype: torch.dtype,
    ) -> None:
        self._gid = gid
        self._group = group
        self._ctx = ctx
        self._shard = shard
        self._outer = outer
        self._sharding = sharding
        self._tp = tp
        self._main_dtype = main_dtype
        self.grad_scale = grad_scale
        self.state = GradState.EMPTY
        # ``param.main_grad`` of each parameter: views into the main-grad storage
        # (``point_main_grads``; the staging bucket where gradients are sharded).
        self._grad_views: list[torch.Tensor] = []
        self._chunk_cat: bool | None = None  # see ``_chunk_cat_applies``
        # The optimizer's gradients cast to the main weights' dtype, when the main
        # grads are in another (made on first use; see ``grads_for_optimizer``).
        self._grads_cast: DataParallelBuffer | None = None
        self._reduce_label = annotate(f"fsdp.reduce.{gid}")
        self._range_copy_in = annotate(f"fsdp.copy_in.{gid}")

    def point_main_grads(self) -> None:
        """``param.main_grad`` views into the gradient storage, once the parameters are
        views into their bucket (``Bucket.point_params_at_buffers``): attached for good
        where gradients are replicated, detached until a backward stages them where
        they are sharded."""
        gbuf = self._group.main_grad_buffer
        if gbuf is None:
            return
        self._grad_views = gbuf.param_views()
        if gbuf.is_data_distributed:
            self._detach_main_grads()
        else:
            self._attach_main_grads()

    def _attach_main_grads(self) -> None:
        """``param.main_grad``: a view of the parameter in the gradients its backward
        accumulates into. Replicated gradients keep it for good. Sharded ones stage in a
        bucket that exists only from ``begin_accumulating`` until the bucket's reduction
        is launched; outside that window ``main_grad`` is None, so a late write fails
        instead of landing in freed or reused memory."""
        for p, view in zip(self._group.params, self._grad_views, strict=True):
            p.main_grad = view  # type: ignore[attr-defined]

    def _detach_main_grads(self) -> None:
        for p in self._group.params:
            p.main_grad = None  # type: ignore[attr-defined]

    @property
    def main_grads(self) -> DataParallelBuffer:
        buf = self._group.main_grad_buffer
        if buf is None:
            raise RuntimeError(f"bucket {self._gid} ({self._group.names[:3]}...) has no gradients")
        return buf

    @property
    def optimizer_grads(self) -> DataParallelBuffer:
        """The optimizer's gradients: the main grads, or their fine slice when main
        weights are sharded over shard x outer."""
        return self._group.hsdp_gbuf or self.main_grads

    def grads_for_optimizer(self) -> DataParallelBuffer:
        """The gradients the optimizer's parameters hold, refreshed now: the
        ``optimizer_grads`` themselves, or, when the main grads are in another dtype
        than the main weights (e.g. ``main_grads_dtype=torch.bfloat16`` with fp32 main
        weights), a copy cast to the main weights' dtype, as Megatron-FSDP makes:
        torch's optimizers need a gradient in its parameter's dtype. The copy has the
        same layout, so the same views; it is kept, and refilled by each call."""
        gbuf = self.optimizer_grads
        self._note_main_grads("read")
        dtype = self._main_dtype
        if gbuf.dtype == dtype:
            return gbuf
        cast = self._grads_cast
        if cast is None or cast.numel != gbuf.numel:
            cast = self._grads_cast = DataParallelBuffer(
                gbuf.layout,
                dtype=dtype,
                device=gbuf.device,
                is_data_distributed=gbuf.is_data_distributed,
                shard_rank=gbuf.shard_rank,
                allocator=self._ctx.scratch,
                name=f"group{self._gid}.optimizer_grad",
                coarse=gbuf.coarse,
            )
        if gbuf.is_released:  # zeros: so is the copy, without allocating either
            cast.release()
            return cast
        with torch.no_grad():
            if cast.is_released:  # Note [released gradients]: a new copy, not zeros + copy
                cast.data = gbuf.data.to(dtype)
            else:
                cast.data.copy_(gbuf.data)
        return cast

    @property
    def needs_grad_copy(self) -> bool:
        """Whether the optimizer's gradients are a cast copy (``grads_for_optimizer``)."""
        return self._group.requires_grad and self.optimizer_grads.dtype != self._main_dtype

    @property
    def optimizer_grad_copy(self) -> DataParallelBuffer | None:
        """The cast copy of the optimizer's gradients, once a step made it."""
        return self._grads_cast

    @property
    def has_grads(self) -> bool:
        """Whether a backward put gradients here since the last ``zero_grads``."""
        return self.state is not GradState.EMPTY

    @property
    def stages_main_grad(self) -> bool:
        """Whether gradients stage in a ``main_grad`` bucket (Note [gradient staging])."""
        return self._ctx.grads.staging is GradStaging.MAIN_GRAD

    def begin_accumulating(self) -> None:
        """-> ACCUMULATING: the storage this backward's gradients add into exists (the
        ``main_grad`` staging bucket when grads are sharded and staged there); reduced
        gradients are rebased first."""
        gbuf = self._group.main_grad_buffer  # per gradient: no property call
        if gbuf is None:
            gbuf = self.main_grads  # raises, naming the bucket
        state = self.state
        if state is not GradState.ACCUMULATING:
            if state is GradState.REDUCED and self._outer is not None:
                self._note_main_grads("write")
                self._outer.rebase()
            if state is not GradState.EMPTY and not gbuf.is_data_distributed:
                self._rebase_shard()
            self.state = GradState.ACCUMULATING
        if (
            gbuf.is_data_distributed
            and self.stages_main_grad
            and not gbuf.allocator.is_allocated(gbuf)
        ):
            gbuf.fetch_bucket().zero_()
            self._attach_main_grads()

    def prepare_grads(self) -> None:
        """Before any gradient of a backward reaches the bucket: make ``param.main_grad``
        valid where gradients stage in it (Note [gradient staging])."""
        if self.stages_main_grad:
            self.begin_accumulating()

    def holds_autograd_grads(self) -> bool:
        """Whether a compute parameter holds a ``.grad`` no reduction has taken yet
        (``AUTOGRAD`` staging)."""
        return not self.stages_main_grad and any(p.grad is not None for p in self._group.params)

    def accumulate(self, index: int, param: nn.Parameter) -> None:
        """``MAIN_GRAD`` staging: add ``param.grad`` (parameter ``index`` of the bucket)
        into the staging bucket and drop it. A framework that already added into
        ``param.main_grad`` sets ``param.grad_added_to_main_grad = True`` (Megatron-Core /
        Transformer Engine). ``AUTOGRAD`` staging leaves ``.grad`` where it is."""
        if not self.stages_main_grad:
            return
        if torch.is_grad_enabled():
            # A backward with create_graph=True (hooks of a plain one run with grad mode
            # off): keep the buffers out of the graph. No context object per gradient
            # otherwise.
            with torch.no_grad():
                self.accumulate(index, param)
            return
        self.begin_accumulating()  # the staging bucket may have been reduced and freed
        if getattr(param, "grad_added_to_main_grad", False):
            param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        elif (grad := param.grad) is not None:
            if type(grad) is not torch.Tensor and isinstance(grad, DTensor):  # tensor parallel
                grad = self._tp.local_grad(param, grad)
            self._grad_views[index].add_(grad)
        param.grad = None

    def stage_locally(self) -> None:
        """Keep this backward's gradients unreduced in the replicated main grads (a
        backward under ``no_sync``): ``AUTOGRAD`` staging adds the ``.grad``s in."""
        self.begin_accumulating()
        if not self.stages_main_grad:
            with torch.no_grad():
                self._absorb_grads()

    def _take_grads(self) -> list[torch.Tensor | None]:
        """The compute parameters' local ``.grad``s (None where there is none), dropped
        from the parameters."""
        grads: list[torch.Tensor | None] = []
        for p in self._group.params:
            grad = p.grad
            if grad is not None:
                if type(grad) is not torch.Tensor and isinstance(grad, DTensor):  # tp
                    grad = self._tp.local_grad(p, grad)
                p.grad = None
            grads.append(grad)
        return grads

    def _absorb_grads(self) -> None:
        """Add the ``.grad``s into the replicated main grads (``AUTOGRAD`` staging), in
        one ``_foreach_add_`` (the same adds; it falls back to one ``add_`` per pair where
        devices, dtypes or strides differ)."""
        pairs = [
            (v, g)
            for v, g in zip(self._grad_views, self._take_grads(), strict=True)
            if g is not None
        ]
        if pairs:
            views, grads = zip(*pairs, strict=True)
            torch._foreach_add_(list(views), list(grads))

    def _chunk_cat_applies(self) -> bool:
        """Whether ``torch._chunk_cat`` lays gradients out as the shard layout does:
        every slot row-split along dim 0 into ``torch.chunk`` pieces, back to back in
        parameter order, over one shard group (Note [shard layout])."""
        if self._chunk_cat is None:
            layout = self.main_grads.layout
            offset = 0
            ok = hasattr(torch, "_chunk_cat") and not layout.has_whole
            for slot in layout.slots:
                ok = ok and not slot.replicated and slot.numel > 0 and slot.offset == offset
                offset += slot.width
            coarse = self.main_grads.coarse
            self._chunk_cat = ok and (coarse is None or coarse == layout.shard_count)
        return self._chunk_cat

    def _pack_grads(self, dtype: torch.dtype) -> torch.Tensor:
        """``AUTOGRAD`` staging, sharded gradients: the rank-major reduce-scatter input,
        made from the ``.grad``s in one chunk-cat (FSDP2's ``foreach_reduce``)."""
        gbuf = self.main_grads
        layout = gbuf.layout
        grads = self._take_grads()
        send = torch.empty(layout.total_numel, dtype=dtype, device=self._ctx.device)
        with self._range_copy_in:
            if self._chunk_cat_applies() and all(g is not None for g in grads):
                n = layout.shard_count
                tensors = [g.reshape(g.shape[0], -1) if g.dim() > 1 else g for g in grads]  # type: ignore[union-attr]
                pad = layout.shard_numel - sum(s.width for s in layout.slots)
                if pad:
                    tensors.append(tensors[0].new_zeros(n * pad))
                torch._chunk_cat(tensors, 0, n, out=send.view(n, -1))  # type: ignore[arg-type]
            else:
                targets = layout.staging_targets(send, gbuf.coarse)
                for index, grad in enumerate(grads):
                    if grad is not None:
                        targets.write(index, grad, True)
                targets.zero_rest([g is not None for g in grads])
        return send

    def _scale_and_op(self) -> tuple[float, dist.ReduceOp.RedOpType]:
        if self._ctx.average_in_collective:
            return self.grad_scale * self._shard.size, dist.ReduceOp.AVG
        return self.grad_scale, dist.ReduceOp.SUM

    def _rebase_shard(self) -> None:
        """Turn shard-reduced gradients R back into an unreduced contribution that the
        next reduction maps to R again (Note [gradient states])."""
        gbuf = self.main_grads
        self._note_main_grads("write")
        n, f = self._shard.size, self.grad_scale
        with torch.no_grad():
            if self._sharding.main_weights:  # reduce-scattered: only the local shard is R
                local = gbuf.copy_local_shard()
                gbuf.data.zero_()
                gbuf.set_local_shard(local.div_(f))
            elif abs(n * f - 1.0) > 1e-12:
                gbuf.data.div_(n * f)

    def _note_main_grads(self, op: str) -> None:
        """For a ``StreamRecorder``: the compute stream reads or writes the main grads
        now, which a reduction's follow-up writes on the reduce stream."""
        self._ctx.comm.note(op, StreamKind.COMPUTE, self._gid, "main grads", StreamKind.REDUCE)

    def _shard_reduced(self) -> None:
        self.state = GradState.REDUCED if self._outer is None else GradState.SHARD_REDUCED

    def outer_reduced(self) -> None:
        """SHARD_REDUCED -> REDUCED: called when the outer reduction has landed."""
        self.state = GradState.REDUCED

    @property
    def reduction_holds_storage(self) -> bool:
        """Whether a reduction of this bucket in flight still reads or rewrites the
        storage its gradients go into: replicated gradients (reduced in place, or
        rewritten by the follow-up) or a staging bucket reduced in place. Otherwise
        (sharded gradients packed into a copy) the reduction holds only its copy, and the
        next gradients may be staged meanwhile."""
        gbuf = self.main_grads
        if not gbuf.is_data_distributed:
            return True
        # start_reduce's in-place branch, for staged (not packed) gradients
        return self.stages_main_grad and self._reads_in_place(
            gbuf, self._ctx.grad_comm_dtypes[self._group.dtype]
        )

    @staticmethod
    def _reads_in_place(gbuf: DataParallelBuffer, comm_dtype: torch.dtype) -> bool:
        """Whether the reduction sends ``gbuf``'s unsharded tensor as it is: rank-major
        already, in the communication dtype."""
        return gbuf.layout.is_rank_major(gbuf.coarse) and comm_dtype == gbuf.dtype

    def start_reduce(self) -> PendingCollective:
        """Reduce the gradients this bucket took since its last reduction in the shard
        group. The copy-in (pack, cast) runs on the compute stream; the scaling, the
        collective and the follow-up on the reduce stream (Note [streams and frees]).
        Every rank must call it for the same buckets in the same order, with or without
        local gradients (zeros stand in)."""
        gbuf = self.main_grads
        comm = self._ctx.comm
        if comm.has_streams and self.reduction_holds_storage:  # compute touches it below
            comm.note("write", StreamKind.COMPUTE, self._gid, "gradients", StreamKind.REDUCE)
        self.begin_accumulating()
        autograd = not self.stages_main_grad
        factor, op = self._scale_and_op()
        comm_dtype = self._ctx.grad_comm_dtypes[self._group.dtype]
        pg, stats, label = self._shard.group, self._ctx.stats, self._reduce_label
        with torch.no_grad():
            if not gbuf.is_data_distributed:
                if autograd:
                    self._absorb_grads()
                unsharded = gbuf.data
            elif not autograd:
                unsharded = gbuf.unsharded_tensor()
                self._detach_main_grads()  # reduced from here on: later writes are lost
            if not (self._sharding.grads or self._sharding.main_weights):
                send = unsharded if comm_dtype == gbuf.dtype else unsharded.to(comm_dtype)
                with comm.launch(StreamKind.REDUCE, self._gid):
                    if factor != 1.0:  # the pre-divide, on the reduce stream
                        send.mul_(factor)
                    work = collectives.all_reduce(send, pg, op, stats, label)

                def finish_all_reduce() -> None:
                    if send is not unsharded:
                        unsharded.copy_(send)
                    self._shard_reduced()

                return PendingCollective(work, finish_all_reduce, keepalive=(send,))
            # Gradients to rank-major pieces (Note [shard layout]); a staging bucket is
            # free once they are packed.
            layout = gbuf.layout
            in_place = False  # a staging bucket the reduction reads: freed once waited on
            if gbuf.is_data_distributed and autograd:
                send = self._pack_grads(comm_dtype)
            elif self._reads_in_place(gbuf, comm_dtype):
                send, in_place = unsharded, gbuf.is_data_distributed
            else:
                send = torch.empty(layout.total_numel, dtype=comm_dtype, device=unsharded.device)
                with self._range_copy_in:
                    layout.pack(unsharded, send, gbuf.coarse)
                if self._sharding.grads:
                    gbuf.free_bucket()
            out = torch.empty(
                len(gbuf.owned_shards) * layout.shard_numel, dtype=comm_dtype, device=send.device
            )
            with comm.launch(StreamKind.REDUCE, self._gid):
                if factor != 1.0:  # the pre-divide, on the reduce stream
                    send.mul_(factor)
                work = collectives.reduce_scatter(
                    out, send, pg, op, stats, label, layout.padding_fraction
                )
            if self._sharding.grads:
                # The main-grad shard adopted by the first reduction since zero_grads
                # (Note [released gradients]): ``out``, or a copy in the main grads'
                # dtype made here, on compute, as is everything that outlives the
                # follow-up on the reduce stream.
                adopt = out
                if out.dtype != gbuf.dtype:
                    adopt = torch.empty_like(out, dtype=gbuf.dtype) if gbuf.is_released else None

                def finish() -> None:
                    if adopt is not None and gbuf.is_released:
                        if adopt is not out:
                            adopt.copy_(out)
                        gbuf.data = adopt
                    elif gbuf.is_released:  # would re-make them here, on the reduce stream
                        raise RuntimeError(
                            f"bucket {self._gid}'s main grads were released while its "
                            "reduction was in flight; zero_grad() must not run between a "
                            "backward and the end of its reductions"
                        )
                    else:
                        gbuf.data.add_(out)
                    self._shard_reduced()

                # Only the staging bucket this reduction read in place; never one made
                # meanwhile (GradReducePipeline waits for this first anyway).
                release = gbuf.free_bucket if in_place else None
                return PendingCollective(work, finish, (send, out), release)

            def finish_local_shard() -> None:
                # Only the local shard is meaningful after a reduce-scatter.
                gbuf.data.zero_()
                gbuf.set_local_shard(out)
                self._shard_reduced()

            return PendingCollective(work, finish_local_shard, keepalive=(send, out))

    def start_outer_reduce(self) -> PendingCollective | None:
        """SHARD_REDUCED -> REDUCED across the outer group (hybrid sharding); None when
        there is nothing to reduce. Every rank calls it for the same buckets in order."""
        if self.state is not GradState.SHARD_REDUCED:
            return None
        assert self._outer is not None
        self._note_main_grads("read")  # the copy-in, on compute
        return self._outer.start_grad_reduce(self.outer_reduced)

    def scale_grads(self, factor: float) -> None:
        """Multiply the main grads, and the optimizer's cast copy of them, by ``factor``."""
        self._note_main_grads("write")
        for buf in (self._group.main_grad_buffer, self._grads_cast):
            if buf is not None and not buf.is_released:  # released: zeros already
                buf.data.mul_(factor)

    def zero_grads(self, release: bool = True, keep_pending: bool = False) -> bool:
        """-> EMPTY, with zeroed storage and no ``param.grad``. Sharded main grads (and
        the optimizer's cast copy of them) are released rather than zeroed when
        ``release`` (Note [released gradients]); True when they were. ``keep_pending``:
        only the reduced gradients go; gradients a backward under way gave the compute
        parameters (``.grad``, a staging bucket) stay."""
        gbuf = self._group.main_grad_buffer
        self._note_main_grads("write")
        cast = self._grads_cast
        released = release and gbuf is not None and gbuf.is_data_distributed
        if gbuf is not None:
            if released:
                gbuf.release()
            else:
                gbuf.zero_()
            if gbuf.is_data_distributed and not keep_pending:
                gbuf.free_bucket()
                self._detach_main_grads()
        if cast is not None:
            if released:
                cast.release()
            else:
                cast.zero_()
        if keep_pending:
            self.state = GradState.EMPTY
        else:
            self.forget_grads()
        return released

    def forget_grads(self) -> None:
        """-> EMPTY without touching the storage (its owner zeroes it)."""
        self.state = GradState.EMPTY
        for p in self._group.params:
            p.grad = None

    def main_grad_shard(self) -> torch.Tensor:
        """This rank's shard of the main gradients (a copy when they are replicated)."""
        gbuf = self.main_grads
        self._note_main_grads("read")
        return gbuf.local_shard if gbuf.is_data_distributed else gbuf.copy_local_shard()
