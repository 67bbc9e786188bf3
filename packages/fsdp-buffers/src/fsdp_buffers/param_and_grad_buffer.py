"""``ParamAndGradBuffer``: every group's buffers, as the sharding strategy asks.

For each ``ParameterGroup`` (one bucket) it keeps up to three ``DataParallelBuffer``s
over one shared ``FlatLayout``, so that the same element index means the same value in
each of them:

| buffer        | dtype                  | sharded when                              |
|---------------|------------------------|-------------------------------------------|
| model weight  | the parameters' dtype  | ``optim_grads_params`` (3)                |
| main weight   | ``main_params_dtype``  | ``optim`` (1) and above                   |
| main grad     | ``main_grads_dtype``   | ``optim_grads`` (2) and above             |

A ``fsdp_no_shard`` group, and any group when the shard group has one rank, keeps all
three replicated and all-reduces its gradients. When the main-weight dtype equals the
parameters' dtype there is no separate main-weight buffer: the main weights are the
model-weight buffer's local shard (a slice of it when it is replicated), so fp32
training keeps one copy of the weights, not two.

Note on gradient reduction. Gradients are scaled just before they are reduced, on the
unreduced data (Megatron-FSDP's rule), by ``gradient_scaling_factor`` (1/N for a mean
over the N data-parallel ranks). Sharded-grad groups reduce-scatter a fresh staging
bucket each backward and add the result into the main-grad shard, so microbatches
accumulate in the main-grad dtype. Replicated-grad groups (strategies 0 and 1)
accumulate local gradients in the full main-grad buffer and reduce it in place. If such
a buffer already holds reduced values R when a second backward reduces again before
the optimizer step, R is first rebased to the unreduced value that reduces back to R
(R/(N·f) on every rank for all-reduce; R/f on the owning rank and 0 elsewhere for
reduce-scatter), so syncing every microbatch never double-counts.

Hybrid sharding (an outer data-parallel dim): ``hybrid_sharding.HybridSharding``; tensor
parallelism (tp-local parameters): ``tensor_parallel.TensorParallelViews``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_buffers import collectives
from fsdp_buffers.collectives import CommStats, PendingCollective
from fsdp_buffers.data_parallel_buffer import (
    BucketAllocator,
    DataParallelBuffer,
    DoubleBufferAllocator,
    TemporaryBucketAllocator,
)
from fsdp_buffers.dtensor_views import DTensorViews
from fsdp_buffers.hybrid_sharding import HybridSharding
from fsdp_buffers.layout import DEFAULT_ALIGNMENT, FlatLayout
from fsdp_buffers.mixed_precision import MixedPrecisionPolicy
from fsdp_buffers.param_group import (
    ParameterGroup,
    UnitSpec,
    group_parameters,
    resolve_unit_classes,
)
from fsdp_buffers.profiling import annotate
from fsdp_buffers.strategy import ShardingStrategy
from fsdp_buffers.tensor_parallel import TensorParallelViews

__all__ = ["GradState", "GroupSharding", "ParamAndGradBuffer"]


@dataclass(frozen=True)
class GroupSharding:
    """Which of a group's buffers are sharded."""

    model_weights: bool
    main_weights: bool
    grads: bool


class GradState(enum.Enum):
    """What a group's main-grad storage holds right now."""

    EMPTY = enum.auto()  # zeros
    ACCUMULATING = enum.auto()  # local, unreduced gradients (in the staging bucket if sharded)
    REDUCED = enum.auto()  # reduced gradients, ready for the optimizer


class ParamAndGradBuffer(HybridSharding, DTensorViews, TensorParallelViews):
    """The buffers of every parameter group of ``module`` and the operations on them
    (their DTensor face, for optimizers and checkpoints, is ``DTensorViews``; the
    outer dim of hybrid sharding, ``HybridSharding``; tensor parallelism,
    ``TensorParallelViews``)."""

    def __init__(
        self,
        module: nn.Module,
        dist_index,  # fsdp_mesh.FSDPDistributedIndex
        *,
        strategy: ShardingStrategy | int | str = ShardingStrategy.OPTIM_GRADS_PARAMS,
        mixed_precision_policy: MixedPrecisionPolicy | None = None,
        fsdp_unit_modules: Iterable[UnitSpec] | None = None,
        bucket_size: int | None = None,
        disable_bucketing: bool = False,
        device: torch.device | str | None = None,
        fsdp_double_buffer: bool = False,
        gradient_scaling_factor: float | None = None,
        expert_gradient_scaling_factor: float | None = None,
        average_in_collective: bool = False,
        is_expert_param: Callable[[str, nn.Parameter], bool] | None = None,
        alignment: int = DEFAULT_ALIGNMENT,
        allow_meta: bool = False,
    ) -> None:
        self.module = module
        self.dist_index = dist_index
        self.strategy = ShardingStrategy.parse(strategy)
        if dist_index.hsdp_outer_dp_shard and self.strategy is not (
            ShardingStrategy.OPTIM_GRADS_PARAMS
        ):
            raise ValueError(
                "ParamAndGradBuffer: fully-sharded hybrid sharding (hsdp_outer_dp_shard=True, "
                "outer strategy 'optim') requires strategy 'optim_grads_params'; got "
                f"{self.strategy.megatron_name!r}."
            )
        self.policy = mixed_precision_policy or MixedPrecisionPolicy()
        self.average_in_collective = average_in_collective
        self.stats = CommStats()
        self.device = _check_devices(module, device, allow_meta)
        self._init_tensor_parallel(module)
        unit_classes = resolve_unit_classes(fsdp_unit_modules, module)
        self.groups, self.unit_names = group_parameters(
            module,
            unit_classes,
            bucket_size=bucket_size,
            disable_bucketing=disable_bucketing,
            is_expert_param=is_expert_param,
        )
        self.gradient_scaling_factor = (
            1.0 / dist_index.dp_size if gradient_scaling_factor is None else gradient_scaling_factor
        )
        # Experts too are scaled by 1/(dense data-parallel size), as Megatron-Core does:
        # an expert's local gradient already sums the tokens of every expert-parallel
        # rank (through the token exchange), so summing it over the expert data-parallel
        # ranks counts every rank's loss once, and the mean is over all of them.
        self.expert_gradient_scaling_factor = (
            1.0 / dist_index.dp_size
            if expert_gradient_scaling_factor is None
            else expert_gradient_scaling_factor
        )
        self._temporary_allocator = TemporaryBucketAllocator()
        self.allocator: BucketAllocator = (
            DoubleBufferAllocator(self.device) if fsdp_double_buffer else self._temporary_allocator
        )
        self.param_index: dict[nn.Parameter, tuple[int, int]] = {}
        self.layouts: list[FlatLayout] = []
        self.sharding: list[GroupSharding] = []
        self.grad_state: list[GradState] = []
        self._rebased: list[bool] = []
        # Hybrid sharding (Note [hybrid sharding]).
        self.outer_sharded: list[bool] = []
        self._outer_main: list[DataParallelBuffer | None] = []
        self.outer_pending: list[bool] = []  # shard-reduced, not yet across the outer group
        self.outer_reduced: list[bool] = []  # reduced across the outer group too
        # Each group's parameters become views into its buffers as soon as they are
        # built, so that the group's original tensors are freed before the next group's
        # buffers are allocated (wrapping then holds the model plus one group, not the
        # model twice, and the allocator can reuse the freed memory). Views last with a
        # DoubleBufferAllocator: it sizes its slots once all are registered.
        views_early = not isinstance(self.allocator, DoubleBufferAllocator)
        self._grad_views: dict[int, list[torch.Tensor]] = {}  # see _attach_main_grads
        for gid, group in enumerate(self.groups):
            for i, p in enumerate(group.params):
                self.param_index[p] = (gid, i)
        self.root_groups: list[int] = self._root_groups()
        # Units take turns in the double buffer's two slots in the order they are built.
        self._slot_keys: dict[int, int] = {}
        for gid, group in enumerate(self.groups):
            self._build_group(gid, group, alignment, load=not allow_meta)
            if views_early:
                self._point_params_at_buffers(gid, group)
        if not views_early:
            for gid, group in enumerate(self.groups):
                self._point_params_at_buffers(gid, group)
        self._hybrid_meshes: dict[bool, DeviceMesh] = {}
        for expert in sorted(
            {self.groups[g].is_expert_param for g, o in enumerate(self.outer_sharded) if o}
        ):
            self._init_hybrid_mesh(expert)
        self._optimizer_params: list[tuple[str, nn.Parameter]] | None = None
        self._distributed_params: list[tuple[str, nn.Parameter]] | None = None
        self._name_index: dict[str, tuple[int, int]] | None = None

    # ---- construction -------------------------------------------------------------
    def _build_group(self, gid: int, group: ParameterGroup, alignment: int, load: bool) -> None:
        size, rank = self.shard_group_size(gid), self.shard_group_rank(gid)
        shapes = [self.tp_local_shape(p) for p in group.params]
        shardable = size > 1 and not group.fsdp_no_shard
        s = self.strategy
        layout, outer_sharded = self._hybrid_layout(gid, shapes, shardable, alignment)
        self.layouts.append(layout)
        self.outer_sharded.append(outer_sharded)
        self.outer_pending.append(False)
        self.outer_reduced.append(False)
        sharding = GroupSharding(
            model_weights=shardable and s.shards_model_weights,
            main_weights=shardable and s.shards_main_weights,
            grads=shardable and s.shards_grads,
        )
        self.sharding.append(sharding)
        self.grad_state.append(GradState.EMPTY)
        self._rebased.append(False)
        sources = [self.tp_local_source(p) for p in group.params]

        def make(kind: str, dtype: torch.dtype, sharded: bool) -> DataParallelBuffer:
            # Only units' weight buckets take turns in the double buffer's two slots: a
            # root bucket stays gathered all step and a gradient staging bucket is held
            # until its reduction is waited on, so either would block a unit's slot.
            in_slots = (
                isinstance(self.allocator, DoubleBufferAllocator)
                and sharded
                and kind == "model_weight"
                and gid not in self.root_groups
            )
            buf = DataParallelBuffer(
                layout,
                dtype=dtype,
                device=self.device,
                is_data_distributed=sharded,
                shard_rank=rank,
                allocator=self.allocator if in_slots else self._temporary_allocator,
                name=f"group{gid}.{kind}",
                coarse=size,
            )
            if in_slots:
                key = self._slot_keys.setdefault(group.fsdp_unit_id, len(self._slot_keys))  # type: ignore[arg-type]
                self.allocator.register(buf, key)  # type: ignore[attr-defined]
            return buf

        group.model_weight_buffer = make("model_weight", group.dtype, sharding.model_weights)
        if load:
            group.model_weight_buffer.load_params(sources)
        outer_main: DataParallelBuffer | None = None
        if group.requires_grad:
            main_dtype = self.policy.main_params_dtype_for(group.dtype)
            if outer_sharded:
                # Main weights sharded over shard x outer (Note [hybrid sharding]).
                outer_main = self._fine_buffer(gid, layout, main_dtype, "outer_main_weight")
                if main_dtype == group.dtype:
                    outer_main.data = self._fine_slice(group.model_weight_buffer.data, gid)
                elif load:
                    outer_main.load_params(sources)
            elif main_dtype != group.dtype:
                group.main_weight_buffer = make("main_weight", main_dtype, sharding.main_weights)
                if load:
                    group.main_weight_buffer.load_params(sources)
            grad_dtype = self.policy.main_grads_dtype_for(group.dtype)
            group.main_grad_buffer = make("main_grad", grad_dtype, sharding.grads)
            if outer_sharded:
                # Megatron-FSDP's ``hsdp_gbuf``: the gradients of the fine main weights.
                group.hsdp_gbuf = self._fine_buffer(gid, layout, grad_dtype, "outer_main_grad")
                group.hsdp_gbuf.data = self._fine_slice(group.main_grad_buffer.data, gid)
        self._outer_main.append(outer_main)

    def _point_params_at_buffers(self, gid: int, group: ParameterGroup) -> None:
        # Compute parameters become views into the (possibly not yet gathered) bucket.
        assert group.model_weight_buffer is not None
        views = group.model_weight_buffer.param_views()
        for p, view in zip(group.params, views, strict=True):
            self._set_compute_view(p, view)
        gbuf = group.main_grad_buffer
        if gbuf is not None:
            self._grad_views[gid] = gbuf.param_views()
            if gbuf.is_data_distributed:
                self._detach_main_grads(gid)
            else:
                self._attach_main_grads(gid)

    def _attach_main_grads(self, gid: int) -> None:
        """``param.main_grad``: a view of the parameter in the gradients its backward
        accumulates into. Replicated gradients keep it for good. Sharded ones stage in a
        bucket that exists only from the first gradient (or ``grad_target``) until the
        bucket's reduction is launched; outside that window ``main_grad`` is None, so a
        late write fails instead of landing in freed or reused memory."""
        for p, view in zip(self.groups[gid].params, self._grad_views[gid], strict=True):
            p.main_grad = view  # type: ignore[attr-defined]

    def _detach_main_grads(self, gid: int) -> None:
        for p in self.groups[gid].params:
            p.main_grad = None  # type: ignore[attr-defined]

    # ---- groups and meshes ---------------------------------------------------------
    def shard_group(self, gid: int) -> dist.ProcessGroup:
        return self.dist_index.get_fsdp_group(is_expert_parallel=self.groups[gid].is_expert_param)

    def shard_group_size(self, gid: int) -> int:
        idx = self.dist_index
        return idx.expt_fsdp_size if self.groups[gid].is_expert_param else idx.fsdp_size

    def shard_group_rank(self, gid: int) -> int:
        idx = self.dist_index
        return idx.expt_fsdp_rank if self.groups[gid].is_expert_param else idx.fsdp_rank

    def shard_mesh(self, gid: int) -> DeviceMesh:
        idx = self.dist_index
        if self.groups[gid].is_expert_param:
            return idx.get_submesh(idx.dp_shard_dim, is_expert_parallel=True)
        return idx.fsdp_mesh

    def group_of(self, param: nn.Parameter) -> tuple[int, int]:
        try:
            return self.param_index[param]
        except KeyError:
            raise KeyError(
                "parameter is not managed by this ParamAndGradBuffer (was it replaced "
                "after wrapping?)"
            ) from None

    def named_params(self) -> Iterator[tuple[str, int, int, nn.Parameter]]:
        for gid, group in enumerate(self.groups):
            for i, (name, p) in enumerate(zip(group.names, group.params, strict=True)):
                yield name, gid, i, p

    @property
    def num_buckets(self) -> int:
        return len(self.groups)

    def groups_of_unit(self, unit_id: int | None) -> list[int]:
        return [g for g, grp in enumerate(self.groups) if grp.fsdp_unit_id == unit_id]

    def _root_groups(self) -> list[int]:
        """Buckets gathered for the whole step: those outside every unit, and unit
        buckets holding a parameter that a module outside every unit also owns (weight
        tying, e.g. an output head tied to an embedding unit), as no unit's hooks run
        around that module."""
        found = set(self.groups_of_unit(None))
        units = self.unit_names
        for name, sub in self.module.named_modules():
            if any(u == "" or name == u or name.startswith(u + ".") for u in units):
                continue
            for p in sub._parameters.values():
                if p is not None and p in self.param_index:
                    found.add(self.param_index[p][0])
        return sorted(found)

    def can_gather(self, gid: int) -> bool:
        """Whether bucket ``gid`` can be fetched now (a double-buffer slot may be held
        by another unit)."""
        buf = self.groups[gid].model_weight_buffer
        assert buf is not None
        return not buf.is_data_distributed or buf.allocator.can_allocate(buf)

    def gather_blocked_by(self, gid: int, other: int) -> bool:
        """Whether bucket ``other``, while gathered, keeps ``gid`` from being fetched."""
        buf, other_buf = (
            self.groups[gid].model_weight_buffer,
            self.groups[other].model_weight_buffer,
        )
        assert buf is not None and other_buf is not None
        return buf.allocator is other_buf.allocator and buf.allocator.shares_slot(buf, other_buf)

    def unsharded_bytes(self, gid: int) -> int:
        buf = self.groups[gid].model_weight_buffer
        assert buf is not None
        return buf.layout.total_numel * buf.element_size

    # ---- weights ------------------------------------------------------------------
    def main_weight_buffer(self, gid: int) -> DataParallelBuffer:
        """Where the group's main weights live: their own buffer, or the model weights."""
        group = self.groups[gid]
        buf = self._outer_main[gid] or group.main_weight_buffer or group.model_weight_buffer
        assert buf is not None
        return buf

    def optimizer_grad_buffer(self, gid: int) -> DataParallelBuffer:
        """Where the optimizer's gradients of the group live: the main-grad buffer, or
        its fine slice when main weights are sharded over shard x outer."""
        buf = self.groups[gid].hsdp_gbuf or self.groups[gid].main_grad_buffer
        if buf is None:
            raise RuntimeError(f"group {gid} has no gradient buffer")
        return buf

    def main_weight_is_sharded(self, gid: int) -> bool:
        return self.sharding[gid].main_weights

    def start_param_gather(self, gid: int) -> PendingCollective | None:
        """Fetch the group's bucket and start gathering into it; None when the model
        weights are replicated (nothing to gather)."""
        buf = self.groups[gid].model_weight_buffer
        assert buf is not None
        if not buf.is_data_distributed:
            return None
        bucket = buf.fetch_bucket()
        label = f"fsdp.all_gather.{gid}"
        if buf.layout.is_rank_major(buf.coarse):  # straight into the bucket
            work = collectives.all_gather(
                bucket, buf.data, self.shard_group(gid), self.stats, label
            )
            return PendingCollective(work, keepalive=(bucket,))
        gathered = torch.empty(buf.layout.total_numel, dtype=buf.dtype, device=buf.device)
        work = collectives.all_gather(gathered, buf.data, self.shard_group(gid), self.stats, label)

        def unpack() -> None:
            # Rank-major pieces to parameter-major storage (Note [shard layout]).
            with torch.no_grad(), annotate(f"fsdp.copy_out.{gid}"):
                buf.layout.unpack(gathered, bucket, buf.coarse)

        return PendingCollective(work, unpack, keepalive=(gathered, bucket))

    def release_param_bucket(self, gid: int) -> None:
        buf = self.groups[gid].model_weight_buffer
        assert buf is not None
        with annotate(f"fsdp.release.{gid}"):
            buf.free_bucket()

    def install_optimized_model_weights(self) -> None:
        """Copy the optimizer's main weights into the compute weights; where compute
        weights are replicated but main weights sharded (strategies 1 and 2), all-gather
        them so that every rank has the whole updated model."""
        pending: list[PendingCollective] = []
        with torch.no_grad(), annotate("fsdp.install_optimized_model_weights"):
            for gid, group in enumerate(self.groups):
                if not group.requires_grad:
                    continue
                model = group.model_weight_buffer
                assert model is not None
                if model.is_data_distributed:
                    model.free_bucket()  # any gathered copy is now stale
                if self.outer_sharded[gid]:
                    pending.append(self._start_outer_param_gather(gid))
                    continue
                main = group.main_weight_buffer
                if main is not None:
                    model.copy_shard_from(main)
                if self.sharding[gid].main_weights and not model.is_data_distributed:
                    # Replicated compute weights, sharded main weights: every rank sends
                    # its updated shard and unpacks everyone's (Note [shard layout]).
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
                        self.shard_group(gid),
                        self.stats,
                        label=f"fsdp.param_sync.{gid}",
                    )

                    def unpack(layout=layout, gathered=gathered, model=model) -> None:
                        if gathered is not model.data:
                            layout.unpack(gathered, model.data)

                    pending.append(PendingCollective(work, unpack, keepalive=(send, gathered)))
                    # Each gather holds a rank-major copy of its bucket until unpacked:
                    # at most two in flight, not the whole model's worth.
                    if len(pending) > 1:
                        pending.pop(0).wait()
        for p in pending:
            p.wait()

    def broadcast_params(self, src_group_rank: int = 0) -> None:
        """Make every replicated buffer equal to that of shard-group rank
        ``src_group_rank``; sharded main weights are then re-derived from the model
        weights they shadow, so all ranks hold one consistent model."""
        with torch.no_grad(), annotate("fsdp.broadcast_params"):
            for gid, group in enumerate(self.groups):
                pg = self.shard_group(gid)
                src = dist.get_global_rank(pg, src_group_rank)
                for buf in (group.model_weight_buffer, group.main_weight_buffer):
                    if buf is not None and not buf.is_data_distributed:
                        self.stats.record(
                            collectives.CollectiveKind.BROADCAST,
                            buf.data.numel(),
                            buf.element_size,
                            dist.get_world_size(pg),
                        )
                        dist.broadcast(buf.data, src=src, group=pg)
                main = group.main_weight_buffer
                model = group.model_weight_buffer
                assert model is not None
                if main is not None and main.is_data_distributed and not model.is_data_distributed:
                    main.copy_shard_from(model)
                self._broadcast_outer(gid)

    # ---- gradients ----------------------------------------------------------------
    def has_grads(self, gid: int) -> bool:
        """Whether a backward put gradients into group ``gid`` since the last
        ``zero_grad_buffer`` (or since wrapping)."""
        return self.grad_state[gid] is not GradState.EMPTY

    def grad_target(self, gid: int) -> torch.Tensor:
        """The unsharded tensor this backward's gradients of group ``gid`` accumulate
        into: the staging bucket when grads are sharded, the main-grad buffer if not."""
        group = self.groups[gid]
        gbuf = group.main_grad_buffer
        if gbuf is None:
            raise RuntimeError(f"group {gid} ({group.names[:3]}...) has no gradient buffer")
        if self.grad_state[gid] is GradState.REDUCED and not gbuf.is_data_distributed:
            self._rebase_reduced(gid)
        elif self.outer_reduced[gid]:
            self._rebase_outer(gid)
        if gbuf.is_data_distributed and not gbuf.has_unsharded_data:
            gbuf.fetch_bucket().zero_()
            self._attach_main_grads(gid)
        if self.grad_state[gid] is not GradState.ACCUMULATING:
            self.grad_state[gid] = GradState.ACCUMULATING
        return gbuf.unsharded_tensor()

    def accumulate_param_grad(self, param: nn.Parameter) -> None:
        """Move ``param.grad`` into the group's gradient storage and drop it. A
        framework that already added into ``param.main_grad`` sets
        ``param.grad_added_to_main_grad = True`` (Megatron-Core / Transformer Engine)."""
        gid, i = self.group_of(param)
        target = self.grad_target(gid)
        if getattr(param, "grad_added_to_main_grad", False):
            param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        elif param.grad is not None:
            buf = self.groups[gid].main_grad_buffer
            assert buf is not None
            with torch.no_grad():
                buf.param_view(target, i).add_(self.tp_local_grad(param, param.grad))
        param.grad = None

    def _scale_and_op(self, gid: int, group_size: int) -> tuple[float, dist.ReduceOp.RedOpType]:
        f = (
            self.expert_gradient_scaling_factor
            if self.groups[gid].is_expert_param
            else self.gradient_scaling_factor
        )
        if self.average_in_collective:
            return f * group_size, dist.ReduceOp.AVG
        return f, dist.ReduceOp.SUM

    def _rebase_reduced(self, gid: int) -> None:
        """Turn reduced gradients R back into an unreduced contribution that the next
        reduction maps to R again (see the module note)."""
        gbuf = self.groups[gid].main_grad_buffer
        assert gbuf is not None and not gbuf.is_data_distributed
        if self.outer_reduced[gid]:
            self._rebase_outer(gid)
        n = self.shard_group_size(gid)
        f = self._scale_and_op(gid, n)[0] / (n if self.average_in_collective else 1)
        with torch.no_grad():
            if self.sharding[gid].main_weights:  # reduce-scattered: only the local shard is R
                local = gbuf.copy_local_shard()
                gbuf.data.zero_()
                gbuf.set_local_shard(local.div_(f))
            elif abs(n * f - 1.0) > 1e-12:
                gbuf.data.div_(n * f)
        self.grad_state[gid] = GradState.ACCUMULATING

    def _shard_reduced(self, gid: int) -> None:
        # Outer-group reduction (hybrid) still to come: ``start_outer_grad_reduce``.
        self.grad_state[gid] = GradState.REDUCED
        if self.outer_group_size(gid) > 1:
            self.outer_pending[gid] = True

    def start_grad_reduce(self, gid: int) -> PendingCollective:
        """Scale and reduce this backward's gradients of group ``gid``. Every rank must
        call it for the same groups in the same order, with or without local grads."""
        group = self.groups[gid]
        gbuf = group.main_grad_buffer
        if gbuf is None:
            raise RuntimeError(f"group {gid} has no gradient buffer to reduce")
        unsharded = self.grad_target(gid)  # allocates zeros if no grad arrived here
        if gbuf.is_data_distributed:
            self._detach_main_grads(gid)  # reduced from here on: later writes are lost
        pg = self.shard_group(gid)
        n = self.shard_group_size(gid)
        factor, op = self._scale_and_op(gid, n)
        comm_dtype = self.policy.grad_comm_dtype_for(group.dtype)
        with torch.no_grad():
            label = f"fsdp.reduce.{gid}"
            if self.sharding[gid].grads or self.sharding[gid].main_weights:
                # Parameter-major gradients to rank-major pieces (Note [shard layout]);
                # the staging bucket is free once they are packed.
                layout = gbuf.layout
                if layout.is_rank_major(gbuf.coarse) and comm_dtype == gbuf.dtype:
                    send = unsharded  # in place: freed once the reduction is waited on
                else:
                    send = torch.empty(
                        layout.total_numel, dtype=comm_dtype, device=unsharded.device
                    )
                    with annotate(f"fsdp.copy_in.{gid}"):
                        layout.pack(unsharded, send, gbuf.coarse)
                    if self.sharding[gid].grads:
                        gbuf.free_bucket()
                if factor != 1.0:
                    send.mul_(factor)
                out = torch.empty(
                    len(gbuf.owned_shards) * layout.shard_numel,
                    dtype=comm_dtype,
                    device=send.device,
                )
                work = collectives.reduce_scatter(out, send, pg, op, self.stats, label)
                if self.sharding[gid].grads:

                    def finish() -> None:
                        gbuf.data.add_(out)
                        gbuf.free_bucket()  # no-op unless the reduction read it in place
                        self._shard_reduced(gid)

                else:

                    def finish() -> None:
                        # Only the local shard is meaningful after a reduce-scatter.
                        gbuf.data.zero_()
                        gbuf.set_local_shard(out)
                        self._shard_reduced(gid)

                return PendingCollective(work, finish, keepalive=(send, out))
            send = unsharded if comm_dtype == gbuf.dtype else unsharded.to(comm_dtype)
            if factor != 1.0:
                send.mul_(factor)
            work = collectives.all_reduce(send, pg, op, self.stats, label)

            def finish_all_reduce() -> None:
                if send is not unsharded:
                    unsharded.copy_(send)
                self._shard_reduced(gid)

            return PendingCollective(work, finish_all_reduce, keepalive=(send,))

    def scale_gradients(self, scaling_factor: float) -> None:
        with torch.no_grad():
            for group in self.groups:
                if group.main_grad_buffer is not None:
                    group.main_grad_buffer.data.mul_(scaling_factor)

    def zero_grad_buffer(self) -> None:
        with torch.no_grad(), annotate("fsdp.zero_grad_buffer"):
            for gid, group in enumerate(self.groups):
                if group.main_grad_buffer is not None:
                    group.main_grad_buffer.data.zero_()
                    if group.main_grad_buffer.is_data_distributed:
                        group.main_grad_buffer.free_bucket()
                        self._detach_main_grads(gid)
                self.grad_state[gid] = GradState.EMPTY
                self.outer_pending[gid] = self.outer_reduced[gid] = False
                for p in group.params:
                    p.grad = None

    def main_grad_shard(self, gid: int) -> torch.Tensor:
        """This rank's shard of the group's main gradients (a copy when they are
        replicated)."""
        gbuf = self.groups[gid].main_grad_buffer
        if gbuf is None:
            raise RuntimeError(f"group {gid} has no gradient buffer")
        return gbuf.local_shard if gbuf.is_data_distributed else gbuf.copy_local_shard()

    # ---- accounting ----------------------------------------------------------------
    def persistent_bytes(self) -> int:
        """Bytes held by persistent buffers on this rank (not fetched buckets)."""
        total = 0
        for group in self.groups:
            for buf in (
                group.model_weight_buffer,
                group.main_weight_buffer,
                group.main_grad_buffer,
            ):
                if buf is not None:
                    total += buf.nbytes
        for gid, fine in enumerate(self._outer_main):
            model = self.groups[gid].model_weight_buffer
            aliased = (
                fine is None
                or model is None
                or fine.data.data_ptr() == self._fine_slice(model.data, gid).data_ptr()
            )
            if fine is not None and not aliased:
                total += fine.nbytes
        return total


def _check_devices(
    module: nn.Module, device: torch.device | str | None, allow_meta: bool
) -> torch.device:
    devices = {p.device for p in module.parameters()}
    if any(d.type == "meta" for d in devices) and not allow_meta:
        names = [n for n, p in module.named_parameters() if p.device.type == "meta"][:5]
        raise ValueError(
            f"parameters {names} are on the meta device; materialize the model first, or "
            f"ask for meta-device initialization (init_model_with_meta_device=True)"
        )
    real = {d for d in devices if d.type != "meta"}
    if len(real) > 1:
        by_device: dict[str, list[str]] = {}
        for n, p in module.named_parameters():
            by_device.setdefault(str(p.device), []).append(n)
        summary = {d: names[:3] for d, names in by_device.items()}
        raise ValueError(
            f"parameters are on different devices {sorted(map(str, real))} (e.g. {summary}); "
            f"move the module to one device before wrapping"
        )
    if device is not None:
        target = torch.device(device)
        held = next(iter(real)) if real else target
        # "cuda" and "cuda:0" may name one device; two explicit indices must agree.
        differ = held.type != target.type or (
            held.index is not None and target.index is not None and held.index != target.index
        )
        if differ:
            raise ValueError(
                f"parameters are on {next(iter(real))} but device={target} was requested; "
                f"move the module there first"
            )
        return target
    if real:
        return next(iter(real))
    return torch.device("cpu")
