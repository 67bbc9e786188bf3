"""``Bucket``: one parameter group's buffers, its state, and the collectives on it.

A ``ParamAndGradBuffer`` builds one ``Bucket`` per ``ParameterGroup`` and keeps only
indexes; everything that belongs to one bucket lives here (FSDP2's ``FSDPParamGroup``
plays the same part): its layout and sharding, its process groups (resolved once), its
buffers (on the ``ParameterGroup``, where Megatron-FSDP users look for them), its
compute weights' state and the verbs that move it, and the owners it composes: its
gradients (``grads``) and its outer data-parallel dim (``outer``).

Note [bucket states]. ``status`` (``BucketStatus``) is where the compute weights are:

    EMPTY --start_gather--> GATHER_IN_PROGRESS --wait_gather--> READY_TO_USE --release--> EMPTY

A bucket whose compute weights are replicated is READY_TO_USE, except that under
ZeRO-1/2 (replicated compute weights, sharded main weights) an optimizer step may leave
it STALE (``mark_stale``) instead of all-gathering the updated shards at once; the next
gather is then that all-gather, and release keeps what it gathered:

    READY_TO_USE --mark_stale--> STALE --start_gather--> GATHER_IN_PROGRESS
    GATHER_IN_PROGRESS --wait_gather (or release)--> READY_TO_USE

Its gradients have an owner of their own, ``grads`` (``BucketGradients`` in
``bucket_grads``: staging, reduction, released gradients), with their own state
(``GradState``, Note [gradient states]).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_buffers import collectives
from fsdp_buffers.bucket_grads import BucketGradients
from fsdp_buffers.bucket_state import (
    BucketContext,
    BucketStatus,
    CommGroup,
    GradState,
    GroupSharding,
)
from fsdp_buffers.collectives import PendingCollective, StreamKind
from fsdp_buffers.data_parallel_buffer import (
    BucketAllocator,
    DataParallelBuffer,
    DoubleBufferAllocator,
)
from fsdp_buffers.hybrid_sharding import OuterSharding
from fsdp_buffers.layout import FlatLayout, UnpackTargets
from fsdp_buffers.no_shard import FSDP_WHOLE_ATTR
from fsdp_buffers.param_group import ParameterGroup
from fsdp_buffers.profiling import annotate
from fsdp_buffers.slot_placement import assign_owners, compute_layout
from fsdp_buffers.strategy import ShardingStrategy
from fsdp_buffers.tensor_parallel import TensorParallel

__all__ = ["Bucket", "BucketContext", "BucketStatus", "CommGroup", "GradState", "GroupSharding"]


class Bucket:
    """One bucket: layout, sharding, buffers, process groups, the compute weights'
    state and verbs; its gradients are ``grads``."""

    def __init__(
        self,
        gid: int,
        group: ParameterGroup,
        ctx: BucketContext,
        *,
        strategy: ShardingStrategy,
        shard: CommGroup,
        shard_mesh: DeviceMesh,
        outer: CommGroup | None,
        outer_shards_main_weights: bool,
        tp: TensorParallel,
        grad_scale: float,
        alignment: int,
        allocator: BucketAllocator,
        is_root: bool,
        slot_keys: dict[int | None, int],
        load: bool,
    ) -> None:
        self.gid = gid
        self.group = group
        self.ctx = ctx
        self.shard = shard
        self.shard_mesh = shard_mesh
        self.optimizer_mesh = shard_mesh  # the hybrid mesh instead, set by the buffer
        self.tp = tp
        self.is_root = is_root
        # A shard group of one shards nothing, unless the main weights are to be sharded
        # over the outer dim too (fully-sharded hybrid): then the shard x outer layout
        # applies with one shard rank, and main weights and optimizer state are split
        # across the outer ranks.
        over_outer = outer is not None and outer.size > 1 and outer_shards_main_weights
        shardable = (shard.size > 1 or over_outer) and not group.fsdp_no_shard
        self.sharding = GroupSharding(
            model_weights=shardable and strategy.shards_model_weights,
            main_weights=shardable and strategy.shards_main_weights,
            grads=shardable and strategy.shards_grads,
        )
        # Fully-sharded hybrid: main weights sharded over shard x outer (Note [hybrid
        # sharding]); the layout then has shard x outer pieces.
        outer_sharded = (
            outer is not None
            and outer_shards_main_weights
            and group.requires_grad
            and self.sharding.main_weights
        )
        shapes = [tp.local_shape(p) for p in group.params]
        pieces = shard.size * (outer.size if outer_sharded and outer is not None else 1)
        owners = self._whole_owners(pieces, outer_sharded)
        self.layout: FlatLayout = compute_layout(shapes, pieces, alignment, owners)
        self.outer = (
            OuterSharding(
                outer, outer_sharded, gid=gid, group=group, ctx=ctx, sharding=self.sharding
            )
            if outer is not None
            else None
        )
        self.status = BucketStatus.READY_TO_USE
        self._gather: PendingCollective | None = None
        # The rank-major output of the gather in flight when it is copied out after,
        # and the stream the gathered bucket was allocated on (Note [streams and frees]).
        self._gathered: torch.Tensor | None = None
        self._bucket_stream = StreamKind.COMPUTE
        self._build_buffers(allocator, slot_keys, load)
        if self.outer is not None:
            self.outer.build_fine_buffers(self.layout, shard, tp.local_source, load)
        # Given what they read, not the bucket; the main weights' buffer, so its dtype,
        # is fixed once built.
        self.grads = BucketGradients(
            gid,
            group,
            ctx,
            shard=shard,
            outer=self.outer,
            sharding=self.sharding,
            tp=tp,
            grad_scale=grad_scale,
            main_dtype=self.main_weights.dtype,
        )
        # Whether the compute weights are sharded (so gathered before use); fixed at
        # construction, and read on every prefetch walk.
        self.is_distributed: bool = self.model.is_data_distributed
        if self.is_distributed:
            self.status = BucketStatus.EMPTY
        # Fixed at construction too, and read on every gather or prefetch step.
        model = self.model
        self.unsharded_bytes: int = self.layout.total_numel * model.element_size
        self._gather_label = annotate(f"fsdp.all_gather.{gid}")
        self._gather_padding = model.layout.padding_fraction
        self._gather_in_place = model.layout.is_rank_major(model.coarse)
        # Profiler ranges made once (re-entrant; a bucket's verbs never run on two
        # threads at once).
        self._range_copy_out = annotate(f"fsdp.copy_out.{gid}")
        self._range_release = annotate(f"fsdp.release.{gid}")
        self._range_param_sync = annotate(f"fsdp.param_sync.{gid}")
        # (bucket tensor, coarse, FlatLayout.unpack_targets of it): the copy-out without
        # the layout's lookups per gather (``_copy_out``).
        self._unpack_targets: tuple[torch.Tensor, int | None, UnpackTargets] | None = None
        # (compute buffer tensor, an alias of it with its own version counter): where
        # an install unpacks (see ``start_install``).
        self._install_alias: tuple[torch.Tensor, torch.Tensor] | None = None

    # ---- construction ---------------------------------------------------------------
    def _whole_owners(self, pieces: int, outer_sharded: bool) -> list[int | None] | None:
        """The owner shard of each whole-placed parameter (Note [whole placement]), or None
        when the bucket has none or its main weights are not sharded (then every rank holds
        every parameter whole anyway)."""
        group = self.group
        marked = [bool(getattr(p, FSDP_WHOLE_ATTR, False)) for p in group.params]
        if not any(marked) or not self.sharding.main_weights or not group.requires_grad:
            return None
        if outer_sharded or self.tp.specs is not None:
            names = [n for n, m in zip(group.names, marked, strict=True) if m]
            raise NotImplementedError(
                f"whole placement (for whole-matrix optimizers such as Muon) of {names[:3]} "
                "is not supported with fully-sharded hybrid sharding "
                "(outer_dp_sharding_strategy) or tensor parallelism yet; use "
                "outer_dp_sharding_strategy=0 without tp, or zero_dp_strategy=0"
            )
        sizes = [p.numel() for p, m in zip(group.params, marked, strict=True) if m]
        key = (group.is_expert_param, pieces)
        loads = self.ctx.whole_loads.setdefault(key, [0] * pieces)
        owned = assign_owners(sizes, pieces, loads)
        for owner, size in zip(owned, sizes, strict=True):
            loads[owner] += size
        it = iter(owned)
        return [next(it) if m else None for m in marked]

    def _build_buffers(
        self, allocator: BucketAllocator, slot_keys: dict[int | None, int], load: bool
    ) -> None:
        group, sharding = self.group, self.sharding
        sources = [self.tp.local_source(p) for p in group.params]

        def make(kind: str, dtype: torch.dtype, sharded: bool) -> DataParallelBuffer:
            # Only units' weight buckets take turns in the double buffer's two slots: a
            # root bucket stays gathered all step and a gradient staging bucket is held
            # until its reduction is waited on, so either would block a unit's slot.
            in_slots = (
                isinstance(allocator, DoubleBufferAllocator)
                and sharded
                and kind == "model_weight"
                and not self.is_root
            )
            buf = DataParallelBuffer(
                self.layout,
                dtype=dtype,
                device=self.ctx.device,
                is_data_distributed=sharded,
                shard_rank=self.shard.rank,
                allocator=allocator if in_slots else self.ctx.scratch,
                name=f"group{self.gid}.{kind}",
                coarse=self.shard.size,
            )
            if in_slots:
                # Units take turns in the two slots in the order they are first built.
                assert isinstance(allocator, DoubleBufferAllocator)
                key = slot_keys.setdefault(group.fsdp_unit_id, len(slot_keys))
                allocator.register(buf, key)
            return buf

        policy = self.ctx.policy
        # The compute copy (FSDP2's param_dtype) may differ from the parameters' dtype;
        # the main weights are then loaded from the original values, not its rounding.
        compute_dtype = policy.compute_dtype_for(group.dtype) if group.is_float else group.dtype
        if compute_dtype != group.dtype and any(isinstance(p, DTensor) for p in group.params):
            # A DTensor parameter's spec carries its dtype: a local tensor of another
            # dtype under it would make DTensor's propagation wrong.
            raise NotImplementedError(
                f"param_dtype={compute_dtype} over tensor-parallel (DTensor) {group.dtype} "
                f"parameters ({group.names[:3]}) is not supported yet; cast the model to "
                f"{compute_dtype} before wrapping (main weights stay in main_params_dtype)"
            )
        group.model_weight_buffer = make("model_weight", compute_dtype, sharding.model_weights)
        if load:
            group.model_weight_buffer.load_params(sources)
        if not group.requires_grad:
            if compute_dtype != group.dtype:
                raise ValueError(
                    f"param_dtype={compute_dtype}: frozen parameters {group.names[:3]} are "
                    f"{group.dtype} and have no main weights to keep that precision in; "
                    f"cast them to {compute_dtype} before wrapping"
                )
            return
        main_dtype = policy.main_params_dtype_for(group.dtype)
        fine = self.outer is not None and self.outer.sharded
        if main_dtype != compute_dtype and not fine:
            group.main_weight_buffer = make("main_weight", main_dtype, sharding.main_weights)
            if load:
                group.main_weight_buffer.load_params(sources)
        grad_dtype = policy.main_grads_dtype_for(group.dtype)
        group.main_grad_buffer = make("main_grad", grad_dtype, sharding.grads)
        if (
            sharding.grads
        ):  # Note [released gradients] (bucket_grads): none until a backward reduces
            group.main_grad_buffer.release()

    def point_params_at_buffers(self) -> None:
        """Compute parameters become views into the (possibly not yet gathered) bucket;
        ``param.main_grad`` views into the gradient storage."""
        for p, view in zip(self.group.params, self.model.param_views(), strict=True):
            self.tp.set_compute_view(p, view)
        self.grads.point_main_grads()

    # ---- what it holds --------------------------------------------------------------
    @property
    def model(self) -> DataParallelBuffer:
        buf = self.group.model_weight_buffer
        assert buf is not None
        return buf

    @property
    def main_weights(self) -> DataParallelBuffer:
        """Where the main weights live: the fine buffer of fully-sharded hybrid
        sharding, their own buffer, or the model weights."""
        fine = self.outer.fine_main if self.outer is not None else None
        buf = fine or self.group.main_weight_buffer or self.group.model_weight_buffer
        assert buf is not None
        return buf

    @property
    def outer_sharded(self) -> bool:
        return self.outer is not None and self.outer.sharded

    def persistent_bytes(self) -> int:
        """Bytes held by this bucket's persistent buffers (not fetched buckets)."""
        group = self.group
        bufs = (
            group.model_weight_buffer,
            group.main_weight_buffer,
            group.main_grad_buffer,
            self.grads.optimizer_grad_copy,
        )
        total = sum(b.nbytes for b in bufs if b is not None)
        if self.outer is not None:
            total += self.outer.own_bytes()
        return total

    # ---- compute weights ------------------------------------------------------------
    def can_gather(self) -> bool:
        """Whether the bucket can be fetched now (a double-buffer slot may be held)."""
        model = self.group.model_weight_buffer  # per gather and prefetch step: no property
        assert model is not None
        return not model.is_data_distributed or model.allocator.can_allocate(model)

    def blocked_by(self, other: Bucket) -> bool:
        """Whether ``other``, while gathered, keeps this bucket from being fetched."""
        a, b = self.model, other.model
        return a.allocator is b.allocator and a.allocator.shares_slot(a, b)

    def start_gather(self) -> None:
        """EMPTY -> GATHER_IN_PROGRESS: start the all-gather on the gather stream (the
        bucket is fetched when it lands, or now when its memory is a shared slot).
        STALE -> GATHER_IN_PROGRESS: start the install's all-gather (``start_install``;
        on the current stream, waited on by ``_finish_gather`` like any gather)."""
        if self.status is BucketStatus.STALE:
            self._gather = self.start_install()
            self.status = BucketStatus.GATHER_IN_PROGRESS
            return
        if self.status is not BucketStatus.EMPTY:
            return
        buf = self.group.model_weight_buffer
        assert buf is not None
        label = self._gather_label
        pg = self.shard.group
        pad = self._gather_padding
        ctx = self.ctx
        # Allocated on the gather stream, freed after it waits on the reads (Note
        # [streams and frees]): the bucket gathered in place, or the rank-major output.
        with ctx.comm.launch(StreamKind.GATHER, self.gid):
            if self._gather_in_place:  # rank-major already: straight into the bucket
                out = buf.fetch_bucket()
                self._gathered = None
                self._bucket_stream = StreamKind.GATHER
            else:
                # The parameter-major bucket is fetched at copy-out, on the compute
                # stream, as FSDP2 allocates its unsharded parameters: while a gather is
                # in flight (a prefetch spans the whole compute of the unit before),
                # only its rank-major output exists. A shared slot is reserved now.
                if buf.allocator.shares_memory:
                    buf.fetch_bucket()
                out = self._gathered = torch.empty(
                    buf.layout.total_numel, dtype=buf.dtype, device=buf.device
                )
                self._bucket_stream = StreamKind.COMPUTE
            work = collectives.all_gather(out, buf.data, pg, ctx.stats, label, pad)
        self._gather = PendingCollective(work, keepalive=(out,))
        self.status = BucketStatus.GATHER_IN_PROGRESS

    @property
    def gather_in_flight(self) -> bool:
        """Whether an all-gather was started and not waited on yet."""
        return self._gather is not None

    def _finish_gather(self, what: str) -> None:
        """The compute stream waits on the gather in flight, then copies the rank-major
        output out to the parameter-major bucket (Note [shard layout]) and frees it."""
        pending, self._gather = self._gather, None
        if pending is None:
            return
        comm = self.ctx.comm
        comm.wait(pending, what, StreamKind.GATHER, self.gid)
        gathered, self._gathered = self._gathered, None
        if gathered is None:
            return
        buf = self.group.model_weight_buffer
        assert buf is not None
        # Neither tensor requires grad (both plain allocations; parameters are views,
        # not the other way round), so autograd records nothing even with grad mode on:
        # no no_grad context per gather.
        with self._range_copy_out:
            comm.note("read", StreamKind.COMPUTE, self.gid, "gather output")
            self._copy_out(gathered, buf.fetch_bucket(), buf.coarse)
        comm.free(StreamKind.GATHER, StreamKind.COMPUTE, self.gid, "gather output")
        del gathered

    def _copy_out(
        self, gathered: torch.Tensor, pm: torch.Tensor, coarse: int | None = None
    ) -> None:
        """Copy the rank-major all-gather output ``gathered`` into the parameter-major
        ``pm`` (``FlatLayout.unpack``): ``UnpackTargets.copy`` into the layout's views
        of ``pm``, made once per tensor (the bucket's, or the compute buffer's or
        its alias for installs: a bucket uses one of them)."""
        kept = self._unpack_targets
        if kept is None or kept[0] is not pm or kept[1] != coarse:
            kept = self._unpack_targets = (pm, coarse, self.model.layout.unpack_targets(pm, coarse))
        kept[2].copy(gathered)

    def wait_gather(self, what: str) -> None:
        """-> READY_TO_USE, gathering first if nothing is in flight."""
        if self.status is BucketStatus.EMPTY or self.status is BucketStatus.STALE:
            self.start_gather()
        self._finish_gather(what)
        self.status = BucketStatus.READY_TO_USE
        self.ctx.comm.note("read", StreamKind.COMPUTE, self.gid, "gathered bucket")

    def release(self, what: str) -> None:
        """-> EMPTY: free the gathered bucket (a gather in flight is finished first: its
        output is in use by the collective). Replicated compute weights are kept: a
        gather in flight is landed (-> READY_TO_USE), a STALE bucket stays STALE."""
        if not self.is_distributed:
            if self.status is BucketStatus.GATHER_IN_PROGRESS:
                self.wait_gather(what)
            return
        self._finish_gather(what)
        model = self.group.model_weight_buffer
        assert model is not None
        with self._range_release:
            if model.has_unsharded_data:
                # Gathered in place: allocated on GATHER; else allocated on COMPUTE at
                # copy-out, and only compute used it.
                self.ctx.comm.free(
                    self._bucket_stream, StreamKind.COMPUTE, self.gid, "gathered bucket"
                )
            model.free_bucket()
        self.status = BucketStatus.EMPTY

    # ---- main weights ---------------------------------------------------------------
    @property
    def can_be_stale(self) -> bool:
        """Whether an optimizer step may leave this bucket STALE, for the next forward's
        gather (``mark_stale``): its install is an all-gather of sharded main weights
        into replicated compute weights (ZeRO-1/2), outside fully-sharded hybrid
        sharding, whose all-gather output is not memory a user can read meanwhile (the
        main weights' own storage, when they are the compute buffer's local shard and
        the layout is rank-major, so the gather would write into them)."""
        model = self.model
        return (
            self.group.requires_grad
            and self.sharding.main_weights
            and not model.is_data_distributed
            and (self.outer is None or not self.outer.sharded)
            and len(model.owned_shards) == 1
            and (self.group.main_weight_buffer is not None or not model.layout.is_rank_major())
        )

    def mark_stale(self) -> None:
        """-> STALE: the main weights were stepped and the compute weights not installed;
        the next ``start_gather`` installs them (only where ``can_be_stale``)."""
        if not self.can_be_stale:
            raise RuntimeError(
                f"bucket {self.gid} ({self.group.names[:3]}) cannot be left stale: its "
                "install is not an all-gather into replicated compute weights"
            )
        self.release("a gather of stale weights")  # one in flight lands first
        self.status = BucketStatus.STALE

    def start_install(self) -> PendingCollective | None:
        """Copy the optimizer's main weights into the compute weights; where compute
        weights are replicated but main weights sharded (strategies 1 and 2), start the
        all-gather that gives every rank the whole updated bucket (the caller waits for
        it before the weights are read). Where the main weights are the compute
        buffer's local shard, the copy-out goes through an alias of the buffer with a
        version counter of its own, so that it never looks like a user's write to the
        version counters of the main weights (``fsdp_hooks``' ParamState)."""
        if not self.group.requires_grad:
            return None
        model = self.model
        self.release("a stale gathered bucket")  # any gathered copy is now stale
        if self.outer is not None and self.outer.sharded:
            return self.outer.start_param_gather()
        main = self.group.main_weight_buffer
        if main is not None:
            model.copy_shard_from(main)
        if not self.sharding.main_weights or model.is_data_distributed:
            return None
        self.status = BucketStatus.READY_TO_USE  # once the returned gather is waited
        # Replicated compute weights, sharded main weights: every rank sends its updated
        # shard and unpacks everyone's (Note [shard layout]).
        send = (
            main.data.to(model.dtype)
            if main is not None and main.is_data_distributed
            else model.copy_local_shard()
        )
        layout = model.layout
        gathered = (
            model.data
            if layout.is_rank_major()
            else torch.empty(layout.total_numel, dtype=model.dtype, device=model.device)
        )
        work = collectives.all_gather(
            gathered,
            send,
            self.shard.group,
            self.ctx.stats,
            label=self._range_param_sync,
            padding=layout.padding_fraction,
        )
        if gathered is model.data:
            return PendingCollective(work, keepalive=(send, gathered))
        pm = model.data if main is not None else self._alias()
        copy_out = functools.partial(self._copy_out, gathered, pm)
        return PendingCollective(work, copy_out, (send, gathered))

    def _alias(self) -> torch.Tensor:
        """The compute buffer's tensor under a version counter of its own."""
        alias = self._install_alias
        data = self.model.data
        if alias is None or alias[0] is not data:
            view = torch.empty(0, dtype=data.dtype, device=data.device)
            view.set_(data.untyped_storage(), data.storage_offset(), data.size(), data.stride())
            alias = self._install_alias = (data, view)
        return alias[1]

    def broadcast(self, src_group_rank: int) -> None:
        """Make every replicated buffer equal to shard-group rank ``src_group_rank``'s
        (and the outer replicas equal to outer rank 0's); sharded main weights are then
        re-derived from the model weights they shadow."""
        if self.status is BucketStatus.STALE:  # broadcast the current weights
            pending = self.start_install()
            if pending is not None:
                pending.wait(f"the weight all-gather of bucket {self.gid}")
        pg = self.shard.group
        src = dist.get_global_rank(pg, src_group_rank)
        group = self.group
        main = group.main_weight_buffer
        rederived = (main is not None and main.is_data_distributed) and not self.is_distributed
        if self.outer is not None and self.outer.fine_main is not None:
            rederived = True  # fully-sharded HSDP: from the outer-broadcast compute shard
        if rederived and self.model.dtype != group.dtype:
            # Sharded main weights are re-derived from the broadcast compute weights: a
            # compute copy in another dtype than the parameters' (param_dtype) would
            # round them.
            raise NotImplementedError(
                f"broadcast_params with param_dtype={self.model.dtype} over {group.dtype} "
                f"parameters ({group.names[:3]}) under ZeRO-1/2 or fully-sharded HSDP: the "
                f"{group.dtype} main weights would be re-derived from their "
                f"{self.model.dtype} rounding. Make the ranks' initial weights equal before "
                f"wrapping (or use zero_dp_strategy 0 or 3 without outer sharding)."
            )
        for buf in (group.model_weight_buffer, group.main_weight_buffer):
            if buf is not None and not buf.is_data_distributed:
                self.ctx.stats.record(
                    collectives.CollectiveKind.BROADCAST,
                    buf.data.numel(),
                    buf.element_size,
                    self.shard.size,
                )
                dist.broadcast(buf.data, src=src, group=pg)
        main, model = group.main_weight_buffer, self.model
        if main is not None and main.is_data_distributed and not model.is_data_distributed:
            main.copy_shard_from(model)
        if self.outer is not None:
            self.outer.broadcast()
