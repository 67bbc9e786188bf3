"""``BucketGradients``: the gradient half of a ``Bucket`` (``bucket.py``): where a
backward's gradients stage, how they are reduced, and how long the reduced ones live.

Note [rank-major staging]. A sharded-grad bucket stages parameter-major, zeroed, with
``param.main_grad`` views (what frameworks that add into ``main_grad`` themselves need),
and packs the staging bucket into a rank-major tensor for the reduce-scatter, until every
trainable parameter of it has brought a plain ``.grad`` at least once and none came with
``grad_added_to_main_grad``. From the next backward on it stages rank-major instead
(a parameter that never gets a gradient keeps its bucket parameter-major): each
gradient goes straight to its
``torch.chunk`` pieces in reduce-scatter order (copied when it is the parameter's first
in the backward, added after), the staging bucket is not zeroed first (only what no
gradient reached, and padding, is zeroed at the reduction), and the bucket itself is the
reduce-scatter's input: no zeroing pass, no pack copy, and a copy instead of an add.
The values sent are the same bits. ``main_grad`` then stays None, and a fused write
seen later raises.

Note [held gradients]. A rank-major staging bucket is made when the first gradient that
needs it arrives, not at the pre-backward (``prepare_grads``: no ``main_grad`` views to
make valid in that mode). A gradient that arrives while it does not exist, and that
with those already held is at most ``1/HOLD_FRACTION`` of the bucket, is held aside
(taken from ``.grad`` as any gradient is; a later one for the same parameter is added
to it); the next gradient past that share, or the reduction, makes the bucket and
writes the held ones first.
This is for buckets whose gradients come spread over the whole backward: a root
bucket of a GPT with tied embeddings gets its final norm's small gradients right
after the head's backward and the embedding's (almost all of the bucket) at the very
end, so a bucket made at the first one is held through every block's backward, on
top of the three embedding-sized tensors autograd has alive when it adds the head's
and the embedding's gradients (32 MB each on the 49M GPT: docs/benchmarks.md, 11th
session). Until the bucket is made, holding saves the whole bucket less what is held;
when it is made, the held gradients (at most an eighth of it) are alive beside it until
written. ``zero_grads`` drops held gradients with the rest.

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

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_buffers import collectives
from fsdp_buffers.bucket_state import BucketContext, CommGroup, GradState, GroupSharding
from fsdp_buffers.collectives import PendingCollective
from fsdp_buffers.comm_context import StreamKind
from fsdp_buffers.data_parallel_buffer import DataParallelBuffer, TemporaryBucketAllocator
from fsdp_buffers.layout import StagingTargets
from fsdp_buffers.param_group import ParameterGroup
from fsdp_buffers.profiling import annotate

if TYPE_CHECKING:
    from fsdp_buffers.hybrid_sharding import OuterSharding
    from fsdp_buffers.tensor_parallel import TensorParallel

__all__ = ["BucketGradients"]

# Note [held gradients]: a bucket is made once its held gradients would pass this
# fraction of it.
HOLD_FRACTION = 8


class BucketGradients:
    """Gradient verbs and views of a ``Bucket``; its state is set up by ``Bucket``."""

    gid: int
    group: ParameterGroup
    ctx: BucketContext
    shard: CommGroup
    outer: OuterSharding | None
    sharding: GroupSharding
    tp: TensorParallel
    grad_state: GradState
    grad_scale: float
    _grad_views: list[torch.Tensor]
    _grads_cast: DataParallelBuffer | None
    _plain: list[bool]
    _plain_missing: int
    _fused: bool
    _direct: bool
    _touched: list[bool]
    _held: dict[int, torch.Tensor]
    _held_numel: int
    _targets: StagingTargets | None
    _grad_probe: torch.Tensor | bool | None
    _reduce_label: annotate
    main_weights: DataParallelBuffer  # a property of Bucket

    def _attach_main_grads(self) -> None:
        """``param.main_grad``: a view of the parameter in the gradients its backward
        accumulates into. Replicated gradients keep it for good. Sharded ones stage in a
        bucket that exists only from ``begin_accumulating`` until the bucket's reduction
        is launched; outside that window ``main_grad`` is None, so a late write fails
        instead of landing in freed or reused memory."""
        for p, view in zip(self.group.params, self._grad_views, strict=True):
            p.main_grad = view  # type: ignore[attr-defined]

    def _detach_main_grads(self) -> None:
        for p in self.group.params:
            p.main_grad = None  # type: ignore[attr-defined]

    @property
    def main_grads(self) -> DataParallelBuffer:
        buf = self.group.main_grad_buffer
        if buf is None:
            raise RuntimeError(f"bucket {self.gid} ({self.group.names[:3]}...) has no gradients")
        return buf

    @property
    def optimizer_grads(self) -> DataParallelBuffer:
        """The optimizer's gradients: the main grads, or their fine slice when main
        weights are sharded over shard x outer."""
        return self.group.hsdp_gbuf or self.main_grads

    def grads_for_optimizer(self) -> DataParallelBuffer:
        """The gradients the optimizer's parameters hold, refreshed now: the
        ``optimizer_grads`` themselves, or, when the main grads are in another dtype
        than the main weights (e.g. ``main_grads_dtype=torch.bfloat16`` with fp32 main
        weights), a copy cast to the main weights' dtype, as Megatron-FSDP makes:
        torch's optimizers need a gradient in its parameter's dtype. The copy has the
        same layout, so the same views; it is kept, and refilled by each call."""
        gbuf = self.optimizer_grads
        dtype = self.main_weights.dtype
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
                allocator=self.ctx.scratch,
                name=f"group{self.gid}.optimizer_grad",
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
        return self.group.requires_grad and self.optimizer_grads.dtype != self.main_weights.dtype

    @property
    def optimizer_grad_copy(self) -> DataParallelBuffer | None:
        """The cast copy of the optimizer's gradients, once a step made it."""
        return self._grads_cast

    @property
    def has_grads(self) -> bool:
        """Whether a backward put gradients here since the last ``zero_grads``."""
        return self.grad_state is not GradState.EMPTY

    def begin_accumulating(self) -> None:
        """-> ACCUMULATING: the storage this backward's gradients add into exists (the
        staging bucket when grads are sharded); reduced gradients are rebased first."""
        gbuf = self.group.main_grad_buffer  # per gradient: no property call
        if gbuf is None:
            gbuf = self.main_grads  # raises, naming the bucket
        state = self.grad_state
        if state is not GradState.ACCUMULATING:
            if state is GradState.REDUCED and self.outer is not None:
                self.outer.rebase(self)
            if state is not GradState.EMPTY and not gbuf.is_data_distributed:
                self._rebase_shard()
            self.grad_state = GradState.ACCUMULATING
        if gbuf.is_data_distributed and not gbuf.allocator.is_allocated(gbuf):
            self._direct = self._next_rank_major()
            if self._direct:  # Note [rank-major staging]: written before it is read
                gbuf.fetch_bucket()
                self._touched = [False] * len(self.group.params)
            else:
                gbuf.fetch_bucket().zero_()
                self._attach_main_grads()
        if self._held:
            self._write_held()
        if self._grad_probe is None:
            # What ``accumulate`` checks per gradient instead of calling this: the state
            # alone when the storage is persistent; the temporary staging bucket's
            # tensor (fixed for the buffer's life) when it may have been freed; else
            # (another allocator) nothing, and this runs for every gradient.
            allocator = gbuf.allocator
            if not gbuf.is_data_distributed:
                self._grad_probe = True
            elif isinstance(allocator, TemporaryBucketAllocator):
                self._grad_probe = allocator.bucket_for(gbuf)
            else:
                self._grad_probe = False

    def _next_rank_major(self) -> bool:
        """Whether a staging bucket made now stages rank-major (Note [rank-major
        staging]): every trainable parameter brought a plain gradient, none a fused one."""
        return self._plain_missing == 0 and not self._fused

    def _stages_later(self) -> bool:
        """Whether this backward's staging bucket is rank-major and not made yet (Note
        [held gradients])."""
        gbuf = self.group.main_grad_buffer
        return (
            gbuf is not None
            and gbuf.is_data_distributed
            and self._next_rank_major()
            and not gbuf.allocator.is_allocated(gbuf)
        )

    def prepare_grads(self) -> None:
        """Before any gradient of a backward: make ``param.main_grad`` valid where it is
        kept (``begin_accumulating``). A rank-major staging bucket keeps none, so it is
        made by the gradients themselves (Note [held gradients])."""
        if not self._stages_later():
            self.begin_accumulating()

    def _hold(self, index: int, param: nn.Parameter) -> bool:
        """Take ``param.grad`` aside instead of making the staging bucket for it, if that
        is still cheaper (Note [held gradients]); True when held."""
        grad = param.grad
        if grad is None or getattr(param, "grad_added_to_main_grad", False):
            return False
        if not self._stages_later():
            return False
        if type(grad) is not torch.Tensor and isinstance(grad, DTensor):  # tensor parallel
            grad = self.tp.local_grad(param, grad)
        held = self._held
        if (earlier := held.get(index)) is not None:
            # The parameter's second gradient in this backward; not in place: the first
            # was autograd's, which may share its storage with what it stole it from.
            held[index] = earlier + grad
        else:
            numel = self._held_numel + grad.numel()
            if numel * HOLD_FRACTION > self.main_grads.layout.total_numel:
                return False
            held[index] = grad
            self._held_numel = numel
        param.grad = None
        return True

    def _write_held(self) -> None:
        """Write the held gradients into the staging bucket made now, in arrival order."""
        if not self._direct:
            raise RuntimeError(
                f"bucket {self.gid} holds gradients for a rank-major staging bucket but "
                "stages parameter-major (internal: Note [held gradients])"
            )
        held = self._held
        self._held = {}
        self._held_numel = 0
        targets = self._staging_targets()
        touched = self._touched
        for index, grad in held.items():
            targets.write(index, grad, not touched[index])
            touched[index] = True

    def _staging_targets(self) -> StagingTargets:
        targets = self._targets
        if targets is None:  # made once
            gbuf = self.main_grads
            made = gbuf.allocator.make_views(
                gbuf, lambda rm: [gbuf.layout.staging_targets(rm, gbuf.coarse)]
            )
            targets = self._targets = made[0]
        return targets

    def accumulate(self, index: int, param: nn.Parameter) -> None:
        """Move ``param.grad`` (parameter ``index`` of the bucket) into the gradient
        storage and drop it. A framework that already added into ``param.main_grad``
        sets ``param.grad_added_to_main_grad = True`` (Megatron-Core / Transformer
        Engine)."""
        if torch.is_grad_enabled():
            # A backward with create_graph=True (hooks of a plain one run with grad mode
            # off): keep the buffers out of the graph. No context object per gradient
            # otherwise.
            with torch.no_grad():
                self.accumulate(index, param)
            return
        probe = self._grad_probe
        if (
            self.grad_state is not GradState.ACCUMULATING
            or probe is None
            or probe is False
            or (probe is not True and not probe.untyped_storage().nbytes())
        ):
            if self._hold(index, param):  # Note [held gradients]
                return
            self.begin_accumulating()  # else it would change nothing: one call less
        if getattr(param, "grad_added_to_main_grad", False):
            if self._direct:
                raise RuntimeError(
                    f"{self.group.names[index]!r} came with grad_added_to_main_grad=True in "
                    f"a backward where its bucket {self.gid} stages gradients rank-major "
                    "(param.main_grad is None): every parameter of it brought a plain .grad "
                    "before and none a fused one, so main_grad views are no longer kept. "
                    "A parameter must take the same gradient path in every backward"
                )
            self._fused = True
            param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        elif (grad := param.grad) is not None:
            if type(grad) is not torch.Tensor and isinstance(grad, DTensor):  # tensor parallel
                grad = self.tp.local_grad(param, grad)
            if self._direct:
                touched = self._touched
                targets = self._targets or self._staging_targets()
                targets.write(index, grad, not touched[index])
                touched[index] = True
            else:
                self._grad_views[index].add_(grad)
                if not self._plain[index]:
                    self._plain[index] = True
                    self._plain_missing -= 1
        param.grad = None

    def _scale_and_op(self) -> tuple[float, dist.ReduceOp.RedOpType]:
        if self.ctx.average_in_collective:
            return self.grad_scale * self.shard.size, dist.ReduceOp.AVG
        return self.grad_scale, dist.ReduceOp.SUM

    def _rebase_shard(self) -> None:
        """Turn shard-reduced gradients R back into an unreduced contribution that the
        next reduction maps to R again (module note)."""
        gbuf = self.main_grads
        n, f = self.shard.size, self.grad_scale
        with torch.no_grad():
            if self.sharding.main_weights:  # reduce-scattered: only the local shard is R
                local = gbuf.copy_local_shard()
                gbuf.data.zero_()
                gbuf.set_local_shard(local.div_(f))
            elif abs(n * f - 1.0) > 1e-12:
                gbuf.data.div_(n * f)

    def _shard_reduced(self) -> None:
        self.grad_state = GradState.REDUCED if self.outer is None else GradState.SHARD_REDUCED

    def outer_reduced(self) -> None:
        """SHARD_REDUCED -> REDUCED: called when the outer reduction has landed."""
        self.grad_state = GradState.REDUCED

    def start_reduce(self) -> PendingCollective:
        """Scale and reduce this backward's gradients in the shard group. Every rank
        must call it for the same buckets in the same order, with or without local
        gradients (zeros stand in)."""
        gbuf = self.main_grads
        self.begin_accumulating()
        unsharded = gbuf.unsharded_tensor()
        if gbuf.is_data_distributed:
            self._detach_main_grads()  # reduced from here on: later writes are lost
        factor, op = self._scale_and_op()
        comm_dtype = self.ctx.policy.grad_comm_dtype_for(self.group.dtype)
        pg, stats, label = self.shard.group, self.ctx.stats, self._reduce_label
        with torch.no_grad():
            if not (self.sharding.grads or self.sharding.main_weights):
                send = unsharded if comm_dtype == gbuf.dtype else unsharded.to(comm_dtype)
                if factor != 1.0:
                    send.mul_(factor)
                with self.ctx.comm.launch(StreamKind.REDUCE, self.gid):
                    work = collectives.all_reduce(send, pg, op, stats, label)

                def finish_all_reduce() -> None:
                    if send is not unsharded:
                        unsharded.copy_(send)
                    self._shard_reduced()

                return PendingCollective(work, finish_all_reduce, keepalive=(send,))
            # Parameter-major gradients to rank-major pieces (Note [shard layout]); the
            # staging bucket is free once they are packed.
            layout = gbuf.layout
            direct = gbuf.is_data_distributed and self._direct
            if direct:  # already rank-major (Note [rank-major staging])
                self._staging_targets().zero_rest(self._touched)
                self._direct = False
            if (direct or layout.is_rank_major(gbuf.coarse)) and comm_dtype == gbuf.dtype:
                send = unsharded  # in place: freed once the reduction is waited on
            elif direct:
                send = unsharded.to(comm_dtype)
                if self.sharding.grads:
                    gbuf.free_bucket()
            else:
                send = torch.empty(layout.total_numel, dtype=comm_dtype, device=unsharded.device)
                with annotate(f"fsdp.copy_in.{self.gid}"):
                    layout.pack(unsharded, send, gbuf.coarse)
                if self.sharding.grads:
                    gbuf.free_bucket()
            if factor != 1.0:
                send.mul_(factor)
            out = torch.empty(
                len(gbuf.owned_shards) * layout.shard_numel, dtype=comm_dtype, device=send.device
            )
            with self.ctx.comm.launch(StreamKind.REDUCE, self.gid):
                work = collectives.reduce_scatter(
                    out, send, pg, op, stats, label, layout.padding_fraction
                )
            if self.sharding.grads:

                def finish() -> None:
                    if gbuf.is_released:  # the first reduction since zero_grads: adopt it
                        gbuf.data = out if out.dtype == gbuf.dtype else out.to(gbuf.dtype)
                    else:
                        gbuf.data.add_(out)
                    gbuf.free_bucket()  # no-op unless the reduction read it in place
                    self._shard_reduced()

            else:

                def finish() -> None:
                    # Only the local shard is meaningful after a reduce-scatter.
                    gbuf.data.zero_()
                    gbuf.set_local_shard(out)
                    self._shard_reduced()

            return PendingCollective(work, finish, keepalive=(send, out))

    def start_outer_reduce(self) -> PendingCollective | None:
        """SHARD_REDUCED -> REDUCED across the outer group (hybrid sharding); None when
        there is nothing to reduce. Every rank calls it for the same buckets in order."""
        if self.grad_state is not GradState.SHARD_REDUCED:
            return None
        assert self.outer is not None
        return self.outer.start_grad_reduce(self)

    def scale_grads(self, factor: float) -> None:
        """Multiply the main grads, and the optimizer's cast copy of them, by ``factor``."""
        for buf in (self.group.main_grad_buffer, self._grads_cast):
            if buf is not None and not buf.is_released:  # released: zeros already
                buf.data.mul_(factor)

    def zero_grads(self, release: bool = True) -> bool:
        """-> EMPTY, with zeroed storage and no ``param.grad``. Sharded main grads (and
        the optimizer's cast copy of them) are released rather than zeroed when
        ``release`` (Note [released gradients]); True when they were."""
        gbuf = self.group.main_grad_buffer
        cast = self._grads_cast
        released = release and gbuf is not None and gbuf.is_data_distributed
        if gbuf is not None:
            if released:
                gbuf.release()
            else:
                gbuf.zero_()
            if gbuf.is_data_distributed:
                gbuf.free_bucket()
                self._detach_main_grads()
        if cast is not None:
            if released:
                cast.release()
            else:
                cast.zero_()
        self.forget_grads()
        return released

    def forget_grads(self) -> None:
        """-> EMPTY without touching the storage (its owner zeroes it)."""
        self.grad_state = GradState.EMPTY
        self._held = {}
        self._held_numel = 0
        for p in self.group.params:
            p.grad = None

    def main_grad_shard(self) -> torch.Tensor:
        """This rank's shard of the main gradients (a copy when they are replicated)."""
        gbuf = self.main_grads
        return gbuf.local_shard if gbuf.is_data_distributed else gbuf.copy_local_shard()
