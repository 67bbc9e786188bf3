"""``OuterSharding``: the outer data-parallel dim of a ``Bucket``.

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

Fully-sharded hybrid (``hsdp_outer_dp_shard``, inner strategy ``optim_grads_params``; also
with a shard group of one rank, where only the outer dim splits the main weights):
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

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdp_buffers import collectives
from fsdp_buffers.bucket_state import BucketContext, CommGroup, GroupSharding
from fsdp_buffers.collectives import PendingCollective, StreamKind
from fsdp_buffers.data_parallel_buffer import DataParallelBuffer
from fsdp_buffers.layout import FlatLayout
from fsdp_buffers.param_group import ParameterGroup
from fsdp_buffers.profiling import annotate

__all__ = ["OuterSharding", "hybrid_mesh"]


class OuterSharding:
    """A bucket's outer group and, when its main weights are sharded over shard x
    outer (``sharded``), the fine main-weight buffer and the outer collectives.

    It holds what it reads of its bucket, not the ``Bucket`` (which owns it): the
    bucket's id, its ``ParameterGroup`` (where the buffers live), the buffer's shared
    ``BucketContext`` and which buffers are sharded over the shard group."""

    def __init__(
        self,
        comm: CommGroup,
        sharded: bool,
        *,
        gid: int,
        group: ParameterGroup,
        ctx: BucketContext,
        sharding: GroupSharding,
    ) -> None:
        self.comm = comm
        self.sharded = sharded
        self.fine_main: DataParallelBuffer | None = None
        self._piece = 0  # elements of one piece of the shard x outer layout
        self._gid = gid
        self._group = group
        self._ctx = ctx
        self._sharding = sharding
        # Profiler ranges made once (re-entrant).
        self._range_param_sync = annotate(f"fsdp.outer_param_sync.{gid}")
        self._range_reduce = annotate(f"fsdp.outer_reduce.{gid}")

    @property
    def _model(self) -> DataParallelBuffer:
        buf = self._group.model_weight_buffer
        assert buf is not None
        return buf

    @property
    def _main_grads(self) -> DataParallelBuffer:
        buf = self._group.main_grad_buffer
        if buf is None:
            raise RuntimeError(f"bucket {self._gid} ({self._group.names[:3]}...) has no gradients")
        return buf

    def build_fine_buffers(
        self,
        layout: FlatLayout,
        shard: CommGroup,
        local_source: Callable[[torch.Tensor], torch.Tensor],
        load: bool,
    ) -> None:
        """Fully sharded: the fine main weights (a view of this outer rank's slice of
        the coarse compute shard when the dtypes agree) and ``hsdp_gbuf``
        (Megatron-FSDP's name), the fine slice of the coarse main grads. ``layout``:
        the bucket's shard x outer layout; ``shard``: its shard group;
        ``local_source``: a parameter's local values to load (tensor parallelism)."""
        if not self.sharded:
            return
        group, ctx = self._group, self._ctx
        self._piece = layout.shard_numel
        logical = self.comm.rank * shard.size + shard.rank

        def fine(dtype: torch.dtype, kind: str) -> DataParallelBuffer:
            return DataParallelBuffer(
                layout,
                dtype=dtype,
                device=ctx.device,
                is_data_distributed=True,
                shard_rank=logical,
                allocator=ctx.scratch,
                name=f"group{self._gid}.{kind}",
            )

        model = self._model
        main_dtype = ctx.policy.main_params_dtype_for(group.dtype)
        self.fine_main = fine(main_dtype, "outer_main_weight")
        if main_dtype == model.dtype:
            self.fine_main.data = self.fine_slice(model.data)
        elif load:
            self.fine_main.load_params([local_source(p) for p in group.params])
        grad_dtype = ctx.policy.main_grads_dtype_for(group.dtype)
        group.hsdp_gbuf = fine(grad_dtype, "outer_main_grad")
        # A view that follows the coarse main grads' storage (released between steps).
        group.hsdp_gbuf.follow(self._main_grads, self.fine_slice)

    def fine_slice(self, coarse_shard: torch.Tensor) -> torch.Tensor:
        """This outer rank's fine chunk inside a coarse (shard-group) shard."""
        s, o = self._piece, self.comm.rank
        return coarse_shard[o * s : (o + 1) * s]

    def own_bytes(self) -> int:
        """Bytes of the fine main weights that are not a view of the compute shard."""
        fine = self.fine_main
        if fine is None:
            return 0
        aliased = fine.data.data_ptr() == self.fine_slice(self._model.data).data_ptr()
        return 0 if aliased else fine.nbytes

    def broadcast(self) -> None:
        """Make the shard group's replicas across the outer group equal to outer rank
        0's (after the shard group was synced)."""
        model, main = self._model, self._group.main_weight_buffer
        src_outer = dist.get_global_rank(self.comm.group, 0)
        for buf in (model, main):
            if buf is not None:
                self._ctx.stats.record(
                    collectives.CollectiveKind.BROADCAST,
                    buf.data.numel(),
                    buf.element_size,
                    self.comm.size,
                )
                dist.broadcast(buf.data, src=src_outer, group=self.comm.group)
        if self.fine_main is not None:
            piece = self.fine_slice(model.data)
            if self.fine_main.data.data_ptr() != piece.data_ptr():
                self.fine_main.data.copy_(piece)

    def start_param_gather(self) -> PendingCollective:
        """Fully sharded: put the fine main weights into their slice of the coarse
        compute shard and all-gather the slices across the outer group."""
        model, main = self._model, self.fine_main
        assert main is not None
        piece = self.fine_slice(model.data)
        if main.data.data_ptr() != piece.data_ptr():
            piece.copy_(main.data)
        send = piece.clone()  # the collective's input must not alias its output
        work = collectives.all_gather(
            model.data,
            send,
            self.comm.group,
            self._ctx.stats,
            label=self._range_param_sync,
        )
        return PendingCollective(work, keepalive=(send,))

    def rebase(self) -> None:
        """Undo the outer reduction of R: R/outer on every outer rank after an
        all-reduce; nothing after the fully-sharded reduce-scatter, which left R in
        this rank's chunk and zeros elsewhere."""
        if not self.sharded:
            with torch.no_grad():
                self._main_grads.data.div_(self.comm.size)

    def start_grad_reduce(self, on_reduced: Callable[[], None]) -> PendingCollective:
        """Reduce the bucket's shard-reduced gradients across the outer group;
        ``on_reduced`` is called when the reduction has landed."""
        gbuf = self._main_grads
        pg = self.comm.group
        ctx, gid = self._ctx, self._gid
        comm_dtype = ctx.grad_comm_dtypes[self._group.dtype]
        stats, label = ctx.stats, self._range_reduce
        with torch.no_grad():
            if self.sharded:
                send = gbuf.data if comm_dtype == gbuf.dtype else gbuf.data.to(comm_dtype)
                out = torch.empty(self._piece, dtype=comm_dtype, device=send.device)
                with ctx.comm.launch(StreamKind.REDUCE, gid):
                    work = collectives.reduce_scatter(
                        out, send, pg, dist.ReduceOp.SUM, stats, label
                    )

                def finish_outer_rs() -> None:
                    gbuf.data.zero_()
                    self.fine_slice(gbuf.data).copy_(out)
                    on_reduced()

                return PendingCollective(work, finish_outer_rs, keepalive=(send, out))
            # The part the optimizer reads: the shard after a reduce-scatter (the rest
            # is zeros; packed out of the parameter-major buffer and back), all of it
            # after an all-reduce.
            sharded_rs = self._sharding.main_weights and not gbuf.is_data_distributed
            target = gbuf.copy_local_shard() if sharded_rs else gbuf.data
            send = target if comm_dtype == gbuf.dtype else target.to(comm_dtype)
            with ctx.comm.launch(StreamKind.REDUCE, gid):
                work = collectives.all_reduce(send, pg, dist.ReduceOp.SUM, stats, label)

            def finish_outer_ar() -> None:
                if sharded_rs:
                    gbuf.set_local_shard(send)
                elif send is not target:
                    target.copy_(send)
                on_reduced()

            return PendingCollective(work, finish_outer_ar, keepalive=(send,))


def hybrid_mesh(dist_index, expert: bool) -> DeviceMesh:
    """The 1-D mesh over the hybrid group that fully-sharded main weights live on.
    Coordinate f must hold piece f (outer-major: ``outer_rank * shard + shard_rank``)
    for their ``Shard(0)`` DTensors to be ``torch.chunk`` pieces; checked with one
    ``all_gather_object`` over the hybrid group, the same verdict on every rank."""
    idx = dist_index
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
    return mesh
