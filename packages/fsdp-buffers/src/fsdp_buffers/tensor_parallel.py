"""``TensorParallel``: parameters that are already split across a tensor-parallel group.

Note [tensor parallelism]. With a tensor-parallel dim (``dist_index.tp_dim``) of more
than one rank, or any DTensor parameter, every parameter is classified once
(``tensor_parallel_specs``), by this rule:

* a DTensor on the index's tp mesh (``device_mesh[tp_dim]``, e.g. from torch's
  ``parallelize_module``) with placement ``Shard(d)`` or ``Replicate()``: its local
  tensor is this rank's piece (``torch.chunk`` sized, as DTensor makes them);
* a Megatron-Core tensor-parallel parameter (a plain tensor with
  ``tensor_model_parallel=True`` and ``partition_dim``, ``partition_stride=1``): this
  rank's 1/tp of the global tensor along ``partition_dim``, used as-is in forward;
* any other plain tensor (no marking, or ``tensor_model_parallel=False``): replicated
  over tp. Every tp rank must hold the same values and compute the same gradients
  (layer norms without sequence parallelism); ``fsdp_hooks`` checks the values at
  wrap time.

Refused with an error (on every rank: the rule reads local, rank-independent facts): a
DTensor on any other mesh, or with a ``Partial``/strided placement or pieces that are
not chunk-sized, DTensors without a ``tp_dim``, Megatron ``partition_stride`` > 1 and
``sequence_parallel``/``average_gradients_across_tp_domain`` parameters (their
gradients need a tp reduction fsdp does not do), and tp with an expert mesh. A tp dim of several ranks over a model none of whose parameters is
tensor-parallel is accepted (all replicated over tp), as in Megatron-FSDP.

fsdp then works on the tp-local tensors as on any parameter: layouts, buffers and
collectives of the shard group see local shapes only, and a shard group holds one tp
coordinate, so its ranks agree on them. Three places translate:

1. Compute parameters: a DTensor parameter stays the same object, and its local tensor
   becomes the view into the bucket (a plain one gets ``.data``), so DTensor ops and
   ``parallelize_module``'s hooks see the original mesh and placements (FSDP2 does the
   same).
2. Gradients: a DTensor gradient is redistributed to its parameter's placements (e.g.
   ``Partial`` -> ``Replicate`` for a norm under ``SequenceParallel``: an all-reduce over
   tp), then its local tensor is accumulated.
3. DTensor views (optimizer, state dicts): on the 2-D mesh ``(dp_shard, tp)`` with
   placements (fsdp's ``Shard(0)`` or ``Replicate()``, the tp placement) and the global
   shape. Hybrid sharding changes only fsdp's dim, as without tp (Note [hybrid
   sharding]): replicated over the outer dim, the views stay on ``(dp_shard, tp)``
   (each outer replica is one consistent DTensor world); fully sharded, the main
   weights' views are on ``(dp_outer_dp_shard, tp)``, the flattened hybrid dim by tp.
   The outer and hybrid groups hold one tp coordinate (the tp dim comes after the
   data-parallel dims), so the outer collectives, too, see tp-local shapes. When both
   split dim 0, fsdp's is ``_StridedShard(0, split_factor=tp)`` (fsdp
   splits each tp chunk, FSDP2's convention). ``_fsdp_row_partition`` are rows of the
   tp-local tensor and ``_fsdp_tp_partition`` (tp mesh dim, tensor dim, range per tp
   coordinate) says where that tensor sits in the global one: a checkpoint puts a piece
   at its tp start plus its fsdp row along that dim.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp_buffers.collectives import all_gather_uneven
from fsdp_mesh import get_mcore_tensor_parallel_partition_dim

__all__ = ["TPKind", "TPSpec", "TensorParallel", "chunk_ranges", "tensor_parallel_specs"]

Ranges = tuple[tuple[int, int], ...]


class TPKind(enum.Enum):
    DTENSOR = enum.auto()  # a DTensor on the tp mesh
    MCORE = enum.auto()  # a plain local piece marked by Megatron-Core's attributes
    REPLICATED = enum.auto()  # a plain tensor, the same on every tp rank


@dataclass(frozen=True)
class TPSpec:
    """How one parameter is split across the tensor-parallel group."""

    kind: TPKind
    local_shape: torch.Size
    global_shape: torch.Size
    placement: Placement  # on the tp mesh: Shard(d) or Replicate()
    ranges: Ranges | None  # [start, end) along dim d for each tp coordinate

    @property
    def tensor_dim(self) -> int | None:
        return self.placement.dim if isinstance(self.placement, Shard) else None


def chunk_ranges(size: int, parts: int) -> Ranges:
    """``torch.chunk``'s pieces of ``size`` elements in ``parts`` (DTensor's sizes)."""
    step = -(-size // parts) if parts else 0
    return tuple((min(k * step, size), min((k + 1) * step, size)) for k in range(parts))


def _with_dim(shape: torch.Size, dim: int, size: int) -> torch.Size:
    out = list(shape)
    out[dim] = size
    return torch.Size(out)


def _dtensor_spec(name: str, p: DTensor, tp_mesh, tp_dim: str) -> TPSpec:
    if p.device_mesh != tp_mesh:
        raise ValueError(
            f"parameter {name!r} is a DTensor on {p.device_mesh}, but fsdp's tensor-parallel "
            f"mesh is {tp_mesh} (device_mesh[{tp_dim!r}]); parallelize the model over "
            f"device_mesh[{tp_dim!r}] (fsdp shards on top of it, over the shard dim)"
        )
    (placement,) = p.placements
    if isinstance(placement, Replicate):
        return TPSpec(TPKind.DTENSOR, p.shape, p.shape, Replicate(), None)
    if type(placement) is not Shard:
        raise ValueError(
            f"parameter {name!r} is a DTensor with placement {placement!r}; fsdp supports "
            "tensor-parallel parameters that are Shard(dim) or Replicate() on the tp mesh"
        )
    dim = placement.dim % p.ndim
    ranges = chunk_ranges(p.shape[dim], tp_mesh.size())
    start, end = ranges[tp_mesh.get_local_rank()]
    local = p.to_local().shape
    if local != _with_dim(p.shape, dim, end - start):
        raise NotImplementedError(
            f"parameter {name!r}: this rank's piece has shape {tuple(local)}, not the "
            f"torch.chunk piece {tuple(_with_dim(p.shape, dim, end - start))} of "
            f"{tuple(p.shape)} along dim {dim}; uneven tensor-parallel pieces are not "
            "supported by fsdp"
        )
    return TPSpec(TPKind.DTENSOR, local, p.shape, Shard(dim), ranges)


def _plain_spec(name: str, p: torch.Tensor, tp_size: int) -> TPSpec:
    for attr in ("sequence_parallel", "average_gradients_across_tp_domain"):
        if getattr(p, attr, False):
            raise NotImplementedError(
                f"parameter {name!r} has {attr}=True: its gradient must be reduced over the "
                "tensor-parallel group, which fsdp does not do for plain tensors yet; use "
                "DTensor parameters (SequenceParallel) or turn sequence parallelism off"
            )
    dim = get_mcore_tensor_parallel_partition_dim(p)
    if dim is None:
        return TPSpec(TPKind.REPLICATED, p.shape, p.shape, Replicate(), None)
    if not 0 <= dim < p.ndim:
        raise ValueError(
            f"parameter {name!r} of shape {tuple(p.shape)} has partition_dim={dim}, which "
            "is not one of its dims"
        )
    if getattr(p, "partition_stride", 1) != 1:
        raise NotImplementedError(
            f"parameter {name!r} has partition_stride={p.partition_stride}; strided "
            "tensor-parallel partitions are not supported by fsdp (use partition_stride=1)"
        )
    size = p.shape[dim]
    ranges = tuple((k * size, (k + 1) * size) for k in range(tp_size))
    return TPSpec(
        TPKind.MCORE, p.shape, _with_dim(p.shape, dim, size * tp_size), Shard(dim), ranges
    )


def tensor_parallel_specs(module: nn.Module, dist_index) -> dict[nn.Parameter, TPSpec] | None:
    """Every parameter's ``TPSpec`` (Note [tensor parallelism]); None when tensor
    parallelism is off (no tp dim of more than one rank and no DTensor parameter).
    Local information only: the same verdict, or the same error, on every rank."""
    params = dict(module.named_parameters())
    dtensors = [n for n, p in params.items() if isinstance(p, DTensor)]
    idx = dist_index
    if idx.tp_size <= 1 and not dtensors:
        return None
    if idx.tp_mesh is None:
        raise ValueError(
            f"parameters {dtensors[:5]} are DTensors, but no tp_dim was given; pass "
            "tp_dim naming the dim of device_mesh they are split over (their mesh must be "
            "device_mesh[tp_dim])"
        )
    if idx.has_expert_mesh:
        raise NotImplementedError(
            "tensor parallelism together with an expert-parallel mesh (expt_device_mesh) "
            "is not implemented yet in fsdp"
        )
    names = list(idx.device_mesh.mesh_dim_names or ())
    for arg, dim in (("dp_shard_dim", idx.dp_shard_dim), ("dp_outer_dim", idx.dp_outer_dim)):
        if dim in names and names.index(dim) > names.index(idx.tp_dim):
            raise ValueError(
                f"tp_dim={idx.tp_dim!r} comes before {arg}={dim!r} in device_mesh "
                f"{names}; put the tensor-parallel dim after the data-parallel dims"
            )
    if idx.hsdp_outer_dp_shard and idx.hybrid_fsdp_mesh is None:
        raise NotImplementedError(
            "tensor parallelism with fully-sharded hybrid sharding puts its DTensors on "
            "the hybrid dim x tp, so the hybrid group must be a dim of device_mesh: the "
            "given hybrid_fsdp_group is no flattened dim of its root mesh with the same "
            "ranks in the same order. Pass no hybrid_fsdp_group (fsdp flattens "
            "device_mesh[dp_outer_dim, dp_shard_dim]), or the group of the dim you "
            "flattened from it (device_mesh[(outer, shard)]._flatten(name).get_group())"
        )
    specs = {
        p: _dtensor_spec(n, p, idx.tp_mesh, idx.tp_dim)
        if isinstance(p, DTensor)
        else _plain_spec(n, p, idx.tp_size)
        for n, p in params.items()
    }
    # A tp dim over a model with no tensor-parallel parameter is accepted, as in
    # Megatron-FSDP: every parameter is replicated over tp.
    return specs


class TensorParallel:
    """The tp side of a ``ParamAndGradBuffer``'s parameters (Note [tensor
    parallelism]), decided once at construction. ``specs`` is None when tensor
    parallelism is off; every method then treats parameters as plain tensors."""

    def __init__(self, module: nn.Module, dist_index) -> None:
        self.dist_index = dist_index
        self.specs = tensor_parallel_specs(module, dist_index)
        # fsdp's 1-D mesh (its dim name) -> that dim x tp: the shard mesh, and under
        # fully-sharded hybrid sharding the flattened (outer, shard) mesh too.
        self._meshes_2d: dict[str, DeviceMesh] = {}
        if self.specs is not None:
            dims = [dist_index.dp_shard_dim]
            if dist_index.hsdp_outer_dp_shard:
                dims += list(dist_index.hybrid_fsdp_mesh.mesh_dim_names)
            for dim in dims:
                self._meshes_2d[dim] = dist_index.get_submesh((dim, dist_index.tp_dim))

    def spec(self, p: nn.Parameter) -> TPSpec | None:
        return None if self.specs is None else self.specs[p]

    def local_shape(self, p: nn.Parameter) -> tuple[int, ...]:
        """The shape fsdp lays out and shards: the tp-local one."""
        spec = self.spec(p)
        return tuple(p.shape if spec is None else spec.local_shape)

    def global_shape(self, p: nn.Parameter) -> torch.Size:
        spec = self.spec(p)
        return p.shape if spec is None else spec.global_shape

    @staticmethod
    def local_source(p: nn.Parameter) -> torch.Tensor:
        return (p.to_local() if isinstance(p, DTensor) else p).detach()

    @staticmethod
    def set_compute_view(p: nn.Parameter, view: torch.Tensor) -> None:
        if isinstance(p, DTensor):
            # The same DTensor object (hooks, autograd and the module hold it) over the
            # bucket view: its spec (mesh, placements, global shape) is unchanged.
            p._local_tensor = view
        else:
            p.data = view

    @staticmethod
    def local_grad(p: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        """The tp-local gradient to accumulate: a DTensor gradient in its parameter's
        placements (FSDP2's rule), unwrapped."""
        if not isinstance(grad, DTensor):
            return grad
        if grad.placements != p.placements:
            grad = grad.redistribute(p.device_mesh, p.placements)
        local = grad._local_tensor
        wait = getattr(local, "wait", None)  # AsyncCollectiveTensor from a redistribution
        return wait() if callable(wait) else local

    def view_dtensor(
        self, p: nn.Parameter, local: torch.Tensor, placement: Placement, mesh
    ) -> DTensor:
        """A DTensor over ``local`` (this rank's part of ``p``) with fsdp's
        ``placement`` on ``mesh``, or, under tensor parallelism, on the 2-D mesh with the
        tp placement too."""
        spec = self.spec(p)
        if spec is None:
            shape, placements = p.shape, [placement]
        else:
            (dim,) = mesh.mesh_dim_names
            mesh, shape = self._meshes_2d[dim], spec.global_shape
            if spec.tensor_dim == 0 and placement == Shard(0):
                placement = _StridedShard(0, split_factor=self.dist_index.tp_size)
            placements = [placement, spec.placement]
        return DTensor.from_local(
            local,
            mesh,
            placements,
            run_check=False,
            shape=shape,
            stride=torch.empty(shape, device="meta").stride(),
        )

    def partition(self, p: nn.Parameter) -> tuple[int, int, Ranges] | None:
        """``(tp mesh dim, tensor dim, range per tp coordinate)`` of a tp-split
        parameter's views, None when it is not split (see the module note)."""
        spec = self.spec(p)
        if spec is None or spec.ranges is None:
            return None
        assert spec.tensor_dim is not None
        return (1, spec.tensor_dim, spec.ranges)

    def full(self, p: nn.Parameter, local_full: torch.Tensor) -> torch.Tensor:
        """The global parameter from this rank's whole tp-local one (a collective over
        the tp group when it is split)."""
        spec = self.spec(p)
        if spec is None or spec.ranges is None:
            return local_full
        assert spec.tensor_dim is not None
        return all_gather_uneven(
            local_full, spec.tensor_dim, spec.ranges, self.dist_index.tp_group
        ).view(spec.global_shape)
