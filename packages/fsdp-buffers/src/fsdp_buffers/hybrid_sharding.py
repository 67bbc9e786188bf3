"""``HybridSharding``: the outer data-parallel dim of a ``ParamAndGradBuffer``.

Note [hybrid sharding]. With an outer data-parallel dim (``dist_index.use_hybrid_fsdp``)
every buffer above is laid out and sharded over the shard group exactly as without it,
and replicated across the outer group. Gradients are scaled by 1/(outer x shard) (the
data-parallel group is the hybrid group), reduced inside the shard group as above, and
then reduced across the outer group: an all-reduce of the part the optimizer reads (the
main-grad shard, or the whole buffer when it is not sharded). That outer reduction runs
once per optimizer step, from ``finish_grad_sync`` (``start_outer_grad_reduce``), unless
the backward syncs every microbatch (``GradReducePipeline.sync_grads``); then it runs at
the end of every backward, and the next backward first rebases the fully reduced R to
R/outer (it is the same on every outer rank), so nothing is double-counted.

Fully-sharded hybrid (``hsdp_outer_dp_shard``, inner strategy ``optim_grads_params``):
a trainable group's layout has ``shard x outer`` pieces of S' elements (Note [shard
layout]). Compute weights and main grads are sharded over the shard group in coarse
shards: shard rank k owns pieces ``k + o * shard`` for every outer rank o, as one shard
of ``outer * S'`` elements. Main weights (and so optimizer state) hold one piece each:
outer rank o of shard rank k holds piece ``o * shard + k``, its hybrid-group rank (so the
main weights' DTensors are ``Shard(0)`` on the hybrid mesh), which is the slice
``[o*S', (o+1)*S')`` of the coarse shard. The outer reduction is then a reduce-scatter
of the coarse main-grad shard that leaves chunk o in that slice (and zeros elsewhere, which is already the rebased form). ``install_optimized_model_weights``
copies the fine main weights into their slice of the coarse compute shard and
all-gathers the slices across the outer group: the outer gather runs once per step,
right after the optimizer, so the compute weights (and anything reading them, e.g. a
checkpoint or an eval forward) are current as soon as ``step()`` returns. With fp32
compute weights the fine main weights are a view of that slice (no extra copy).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdp_buffers import collectives
from fsdp_buffers.collectives import PendingCollective
from fsdp_buffers.data_parallel_buffer import DataParallelBuffer
from fsdp_buffers.layout import FlatLayout, compute_layout

__all__ = ["HybridSharding"]


class HybridSharding:
    """Mixed into ``ParamAndGradBuffer``: the outer group, the fine (shard x outer)
    layout of fully-sharded hybrid main weights, and the outer collectives."""

    def outer_group(self, gid: int) -> dist.ProcessGroup | None:
        """The outer data-parallel group of hybrid sharding (None when not hybrid)."""
        return self.dist_index.get_outer_fsdp_group(
            is_expert_parallel=self.groups[gid].is_expert_param
        )

    def outer_group_size(self, gid: int) -> int:
        idx = self.dist_index
        if not idx.use_hybrid_fsdp:
            return 1
        return idx.expt_outer_size if self.groups[gid].is_expert_param else idx.outer_size

    def outer_group_rank(self, gid: int) -> int:
        idx = self.dist_index
        if not idx.use_hybrid_fsdp:
            return 0
        return idx.expt_outer_rank if self.groups[gid].is_expert_param else idx.outer_rank

    def _hybrid_layout(
        self, gid: int, shapes: list[tuple[int, ...]], shardable: bool, alignment: int
    ) -> tuple[FlatLayout, bool]:
        """Group ``gid``'s layout, and whether its main weights are sharded across the
        outer group too (then the layout has shard x outer pieces)."""
        size, outer_n = self.shard_group_size(gid), self.outer_group_size(gid)
        outer_sharded = (
            self.dist_index.hsdp_outer_dp_shard
            and outer_n > 1
            and shardable
            and self.groups[gid].requires_grad
            and self.strategy.shards_main_weights
        )
        if not outer_sharded:
            return compute_layout(shapes, size, alignment), False
        # One layout over shard x outer pieces; the shard-group buffers own ``outer`` of
        # them each (coarse shards, Note [shard layout]): shard rank k holds pieces
        # k + o * size, so piece f is hybrid-group rank f's (outer-major).
        return compute_layout(shapes, size * outer_n, alignment), True

    def _broadcast_outer(self, gid: int) -> None:
        """Make the shard group's replicas across the outer group equal to outer rank
        0's (after ``broadcast_params`` synced the shard group)."""
        outer = self.outer_group(gid)
        if outer is None or self.outer_group_size(gid) <= 1:
            return
        group = self.groups[gid]
        model, main = group.model_weight_buffer, group.main_weight_buffer
        assert model is not None
        src_outer = dist.get_global_rank(outer, 0)
        for buf in (model, main):
            if buf is not None:
                self.stats.record(
                    collectives.CollectiveKind.BROADCAST,
                    buf.data.numel(),
                    buf.element_size,
                    self.outer_group_size(gid),
                )
                dist.broadcast(buf.data, src=src_outer, group=outer)
        fine_main = self._outer_main[gid]
        if fine_main is not None:
            piece = self._fine_slice(model.data, gid)
            if fine_main.data.data_ptr() != piece.data_ptr():
                fine_main.data.copy_(piece)

    def _fine_buffer(
        self, gid: int, fine: FlatLayout, dtype: torch.dtype, kind: str
    ) -> DataParallelBuffer:
        logical = self.outer_group_rank(gid) * self.shard_group_size(gid) + self.shard_group_rank(
            gid
        )
        return DataParallelBuffer(
            fine,
            dtype=dtype,
            device=self.device,
            is_data_distributed=True,
            shard_rank=logical,
            allocator=self._temporary_allocator,
            name=f"group{gid}.{kind}",
        )

    def _fine_slice(self, coarse_shard: torch.Tensor, gid: int) -> torch.Tensor:
        """This outer rank's fine chunk inside a coarse (shard-group) shard."""
        s = self.layouts[gid].shard_numel  # a piece of the shard x outer layout
        o = self.outer_group_rank(gid)
        return coarse_shard[o * s : (o + 1) * s]

    def _init_hybrid_mesh(self, expert: bool) -> None:
        """The 1-D mesh over the hybrid group that fully-sharded main weights live on.
        Coordinate f must hold piece f (outer-major: ``outer_rank * shard + shard_rank``)
        for their ``Shard(0)`` DTensors to be ``torch.chunk`` pieces; checked with one
        ``all_gather_object`` over the hybrid group, the same verdict on every rank."""
        idx = self.dist_index
        group = idx.get_dp_group(is_expert_parallel=expert)
        mesh = None if expert else idx.hybrid_fsdp_mesh
        if mesh is None:
            mesh = DeviceMesh.from_group(group, idx.device_type)
        if expert:
            piece = idx.expt_outer_rank * idx.expt_fsdp_size + idx.expt_fsdp_rank
        else:
            piece = idx.outer_rank * idx.fsdp_size + idx.fsdp_rank
        pairs: list[tuple[int, int]] = [(0, 0)] * dist.get_world_size(group)
        dist.all_gather_object(pairs, (mesh.get_local_rank(), piece), group=group)
        wrong = [(c, f) for c, f in pairs if c != f]
        if wrong:
            raise NotImplementedError(
                "fully-sharded hybrid sharding needs the hybrid group ordered outer-major "
                "(rank outer_rank * shard_size + shard_rank), as flattening "
                "device_mesh[dp_outer_dim, dp_shard_dim] makes it; the given group puts "
                f"(coordinate, piece) pairs {wrong[:4]} out of that order. Let fsdp build "
                "the hybrid group from the mesh."
            )
        self._hybrid_meshes[expert] = mesh

    def optimizer_mesh(self, gid: int) -> DeviceMesh:
        """The mesh of the group's main-weight DTensors: the hybrid mesh when they are
        sharded over shard x outer, and, in that mode, for trainable groups replicated
        everywhere (``fsdp_no_shard``, 0-d), so that every optimizer DTensor shares one
        mesh (``clip_grad_norm_`` cannot mix meshes); else the shard mesh."""
        group = self.groups[gid]
        hybrid = self._hybrid_meshes.get(group.is_expert_param)
        replicated = group.requires_grad and not self.sharding[gid].main_weights
        if hybrid is not None and (self.outer_sharded[gid] or replicated):
            return hybrid
        return self.shard_mesh(gid)

    def _start_outer_param_gather(self, gid: int) -> PendingCollective:
        """Fully-sharded hybrid: put the fine main weights into their slice of the
        coarse compute shard and all-gather the slices across the outer group."""
        model = self.groups[gid].model_weight_buffer
        main = self._outer_main[gid]
        assert model is not None and main is not None
        piece = self._fine_slice(model.data, gid)
        if main.data.data_ptr() != piece.data_ptr():
            piece.copy_(main.data)
        send = piece.clone()  # the collective's input must not alias its output
        work = collectives.all_gather(
            model.data,
            send,
            self.outer_group(gid),
            self.stats,
            label=f"fsdp.outer_param_sync.{gid}",
        )
        return PendingCollective(work, keepalive=(send,))

    def _rebase_outer(self, gid: int) -> None:
        """Undo the outer reduction of R (Note [hybrid sharding]): R/outer on every
        outer rank after an all-reduce; nothing after the fully-sharded reduce-scatter,
        which left R in this rank's chunk and zeros elsewhere."""
        gbuf = self.groups[gid].main_grad_buffer
        assert gbuf is not None
        if not self.outer_sharded[gid]:
            with torch.no_grad():
                gbuf.data.div_(self.outer_group_size(gid))
        self.outer_reduced[gid] = False

    def start_outer_grad_reduce(self, gid: int) -> PendingCollective | None:
        """Reduce group ``gid``'s shard-reduced gradients across the outer group
        (hybrid sharding); None when there is nothing to reduce. Every rank must call
        it for the same groups in the same order."""
        if not self.outer_pending[gid]:
            return None
        self.outer_pending[gid] = False
        group = self.groups[gid]
        gbuf = group.main_grad_buffer
        assert gbuf is not None
        pg = self.outer_group(gid)
        comm_dtype = self.policy.grad_comm_dtype_for(group.dtype)
        label = f"fsdp.outer_reduce.{gid}"
        with torch.no_grad():
            if self.outer_sharded[gid]:
                piece = self.layouts[gid].shard_numel
                send = gbuf.data if comm_dtype == gbuf.dtype else gbuf.data.to(comm_dtype)
                out = torch.empty(piece, dtype=comm_dtype, device=send.device)
                work = collectives.reduce_scatter(
                    out, send, pg, dist.ReduceOp.SUM, self.stats, label
                )

                def finish_outer_rs() -> None:
                    gbuf.data.zero_()
                    self._fine_slice(gbuf.data, gid).copy_(out)
                    self.outer_reduced[gid] = True

                return PendingCollective(work, finish_outer_rs, keepalive=(send, out))
            # The part the optimizer reads: the shard after a reduce-scatter (the rest
            # is zeros; packed out of the parameter-major buffer and back), all of it
            # after an all-reduce.
            sharded_rs = self.sharding[gid].main_weights and not gbuf.is_data_distributed
            target = gbuf.copy_local_shard() if sharded_rs else gbuf.data
            send = target if comm_dtype == gbuf.dtype else target.to(comm_dtype)
            work = collectives.all_reduce(send, pg, dist.ReduceOp.SUM, self.stats, label)

            def finish_outer_ar() -> None:
                if sharded_rs:
                    gbuf.set_local_shard(send)
                elif send is not target:
                    target.copy_(send)
                self.outer_reduced[gid] = True

            return PendingCollective(work, finish_outer_ar, keepalive=(send,))
