"""Uneven row shards in DCP: which rows each rank holds, and telling DCP about them.

Note on uneven shards. DCP places a DTensor's local shard at the offset that DTensor's
metadata implies, and DTensor assumes ``torch.chunk`` sizes. fsdp's own pieces are
``torch.chunk`` ones (fsdp-buffers' Note [shard layout]), so DCP alone places them right;
a DTensor whose pieces are not (another library's, or fsdp's before that layout) would
be written at wrong offsets. fsdp's sharded DTensors carry ``_fsdp_row_partition`` (one
``(row_start, row_end)`` per coordinate of its shard mesh), which states the offsets
without a collective. For DCP we rebuild the DTensor around a
``RowShards`` local tensor (torch's ``LocalShardsWrapper``, which DTensor delegates
``__create_write_items__``/``__create_chunk_list__``/``__get_tensor_shard__`` to)
holding the *same* local tensor, not a copy, at its explicit row offset: DCP then
writes each shard where it belongs and loads in place into the live storage. A rank
whose range is empty takes part in no write or read (an empty chunk at offset 0 would
be deduplicated against rank 0's real one). DTensors without the attribute (other
libraries') are left alone when every local shard is chunk-sized; otherwise one
``all_gather_object`` of local row counts gives each rank its offset.

Tensor parallelism (fsdp's Note [tensor parallelism]): such a parameter lives on a 2-D
mesh (shard dim, tp dim) and also carries ``_fsdp_tp_partition`` = (tp mesh dim, tensor
dim, ``(start, end)`` along that tensor dim per tp coordinate). Its row partition then
counts rows of the tp piece, so a local shard sits at its tp start plus its row offset
(both on dim 0 for a column-parallel weight: tp chunk start + row within the chunk).
Without a row partition (fsdp replicates it) the tp pieces are ``torch.chunk``-sized,
which DCP's own arithmetic places correctly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp_ckpt import _dist
from fsdp_ckpt.errors import CheckpointError
from fsdp_mesh.dtensor_chunks import chunk_of

__all__ = [
    "Partition",
    "RowLayout",
    "RowShards",
    "TensorParallelPart",
    "add_row_offsets",
    "resolve_row_layouts",
    "strip_row_offsets",
]

Partition = tuple[tuple[int, int], ...]
"""``(row_start, row_end)`` for each coordinate of the shard mesh dimension."""

PARTITION_ATTR = "_fsdp_row_partition"
TP_PARTITION_ATTR = "_fsdp_tp_partition"


@dataclass(frozen=True)
class TensorParallelPart:
    """A tensor dim split across a tensor-parallel mesh dim: coordinate ``k`` of mesh
    dimension ``mesh_dim`` holds ``ranges[k]`` along tensor dim ``tensor_dim``."""

    mesh_dim: int
    tensor_dim: int
    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, value: Any) -> TensorParallelPart | None:
        """From the ``(mesh_dim, tensor_dim, ranges)`` a parameter carries."""
        if value is None:
            return None
        mesh_dim, tensor_dim, ranges = value
        return cls(int(mesh_dim), int(tensor_dim), tuple((int(a), int(b)) for a, b in ranges))


@dataclass(frozen=True)
class RowLayout:
    """How a DTensor's dim 0 is split: along mesh dimension ``mesh_dim``, coordinate
    ``k`` holds rows ``partition[k]`` (of its tensor-parallel piece when ``tp`` is set)."""

    mesh_dim: int
    partition: Partition
    tp: TensorParallelPart | None = None

    def rows_of(self, dt: DTensor) -> tuple[int, int]:
        coord = dt.device_mesh.get_coordinate()
        assert coord is not None
        return self.partition[coord[self.mesh_dim]]

    def offset_of(self, dt: DTensor) -> tuple[int, ...]:
        """Where this rank's local shard starts in the global tensor."""
        offset = [self.rows_of(dt)[0]] + [0] * (dt.ndim - 1)
        if self.tp is not None:
            coord = dt.device_mesh.get_coordinate()
            assert coord is not None
            offset[self.tp.tensor_dim] += self.tp.ranges[coord[self.tp.mesh_dim]][0]
        return tuple(offset)


class RowShards(LocalShardsWrapper):
    """A ``LocalShardsWrapper`` of one row range that stays silent when it is empty.

    ``DTensor.from_local`` stores ``local.view_as(local)``; ``handle_view`` keeps that
    view a ``RowShards`` (the base class would return a plain ``LocalShardsWrapper``,
    losing the empty-shard rule). The view shares the shard's storage."""

    @staticmethod
    def handle_view(args: Any, kwargs: Any) -> RowShards:
        out = LocalShardsWrapper.handle_view(args, kwargs)
        return RowShards(out.local_shards(), out.local_offsets())

    def __create_write_items__(self, fqn: str, object: Any) -> list[Any]:
        if all(s.numel() == 0 for s in self.local_shards()):
            return []
        return super().__create_write_items__(fqn, object)

    def __create_chunk_list__(self) -> list[Any]:
        return [
            chunk
            for shard, chunk in zip(self.local_shards(), self.local_chunks, strict=True)
            if shard.numel() > 0
        ]


def _row_shard_dim(dt: DTensor, tp: TensorParallelPart | None = None) -> int | None:
    """The mesh dimension of ``dt``'s ``Shard(0)`` when that is its only sharding
    (besides ``tp``'s mesh dimension, where fsdp's is ``_StridedShard(0)`` when both
    split dim 0), None when it is replicated everywhere; -1 for layouts this module
    cannot describe (they are fine for DCP when chunk-sized, see
    ``resolve_row_layouts``)."""
    skip = None if tp is None else tp.mesh_dim
    shard_dims = [
        i for i, p in enumerate(dt.placements) if i != skip and not isinstance(p, Replicate)
    ]
    if not shard_dims:
        return None
    placement = dt.placements[shard_dims[0]]
    if len(shard_dims) == 1 and (
        placement == Shard(0)
        or (tp is not None and isinstance(placement, _StridedShard) and placement.dim == 0)
    ):
        return shard_dims[0]
    return -1  # something else: Shard(d>0), several shardings, Partial


def _local(dt: DTensor) -> torch.Tensor:
    with torch.no_grad():
        return dt.to_local()


def _chunk_sized(dt: DTensor) -> bool:
    if dt.device_mesh.get_coordinate() is None:
        return True
    return tuple(_local(dt).shape) == tuple(chunk_of(dt).sizes)


Entry = tuple[Any, Partition | None, TensorParallelPart | None]
"""A state dict value, with the row partition and tensor-parallel part it is known
to have (from the parameter it is, or has the shape of), if any."""


def resolve_row_layouts(entries: Mapping[str, Entry]) -> dict[str, RowLayout]:
    """The ``RowLayout`` of every row-sharded DTensor in ``entries`` (key -> (value,
    known partition or None, known tp part or None)) that DCP's chunk arithmetic would
    misplace, plus every one whose partition is known. A collective (one
    ``all_gather_object`` over the default group) on ranks that hold a sharded DTensor
    with no known partition: every rank or none must hold one. Ranks may hold different
    keys (expert parallelism), each key held by every rank of its DTensor's mesh;
    fsdp's DTensors all carry their partition, so no rank communicates for them."""
    layouts: dict[str, RowLayout] = {}
    unknown: list[str] = []
    for key, (value, partition, tp) in entries.items():
        if not isinstance(value, DTensor):
            continue
        if tp is not None and partition is None:
            continue  # tp pieces are chunk-sized, fsdp's dim replicated: DCP's own offsets
        dim = _row_shard_dim(value, tp)
        if dim is None:
            continue
        if partition is not None:
            if dim < 0:
                raise CheckpointError(
                    f"{key!r} carries an fsdp row partition but its placements are "
                    f"{value.placements}; expected Shard(0) on one mesh dimension"
                    + (f" besides the tensor-parallel one ({tp.mesh_dim})" if tp else "")
                )
            _check_partition(key, value, dim, partition)
            layouts[key] = RowLayout(dim, tuple(partition), tp)
        else:
            unknown.append(key)
    if not unknown:
        return layouts
    # Which ranks hold which rows: only the ranks themselves know.
    mine = {k: (_local(entries[k][0]).shape[0], _chunk_sized(entries[k][0])) for k in unknown}
    if _dist.is_distributed():
        everyone: list[dict[str, tuple[int, bool]]] = [{}] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    for key in unknown:
        value = entries[key][0]
        if all(rows[key][1] for rows in everyone if key in rows):
            continue  # chunk-sized everywhere: DCP's own arithmetic is right
        dim = _row_shard_dim(value)
        if dim is None or dim < 0:
            raise CheckpointError(
                f"{key!r} has uneven local shards with placements {value.placements}; only "
                f"uneven Shard(0) on one mesh dimension (others Replicate) can be checkpointed"
            )
        layouts[key] = RowLayout(dim, _partition_from_counts(key, value, dim, everyone))
    return layouts


def _partition_from_counts(
    key: str, dt: DTensor, dim: int, everyone: list[dict[str, tuple[int, bool]]]
) -> Partition:
    coord = dt.device_mesh.get_coordinate()
    assert coord is not None
    index = list(coord)
    parts: list[tuple[int, int]] = []
    start = 0
    for k in range(dt.device_mesh.size(dim)):
        index[dim] = k
        global_rank = int(dt.device_mesh.mesh[tuple(index)].item())
        if key not in everyone[global_rank]:
            raise CheckpointError(
                f"{key!r} is a DTensor on a mesh with rank {global_rank}, which has no "
                f"entry {key!r}; every rank of a DTensor's mesh must hold its key"
            )
        rows = everyone[global_rank][key][0]
        parts.append((start, start + rows))
        start += rows
    if start != dt.shape[0]:
        raise CheckpointError(
            f"the local shards of {key!r} hold {start} rows in all along mesh dimension "
            f"{dim}, but the tensor has {dt.shape[0]}: they do not tile it"
        )
    return tuple(parts)


def _check_partition(key: str, dt: DTensor, dim: int, partition: Partition) -> None:
    size = dt.device_mesh.size(dim)
    if len(partition) != size:
        raise CheckpointError(
            f"the row partition of {key!r} has {len(partition)} parts but its shard mesh "
            f"dimension has {size} ranks"
        )
    coord = dt.device_mesh.get_coordinate()
    if coord is None:
        return
    r0, r1 = partition[coord[dim]]
    rows = _local(dt).shape[0] if dt.ndim else 1
    if r1 - r0 != rows:
        raise CheckpointError(
            f"{key!r}: this rank holds {rows} rows but its row partition says "
            f"[{r0}, {r1}); the partition does not describe this tensor"
        )


def with_offset(dt: DTensor, layout: RowLayout) -> DTensor:
    """``dt`` over a ``RowShards`` local tensor that is ``dt``'s own local tensor."""
    if dt.device_mesh.get_coordinate() is None:
        return dt
    local = _local(dt)
    shards = RowShards([local], [layout.offset_of(dt)])
    # ``dt``'s own spec (mesh, placements, global shape and stride), not ``from_local``:
    # that would go through autograd and a ``view_as`` (a second wrapper) per entry, a
    # third of an asynchronous save's blocked time on a 49M-parameter GPT.
    return DTensor(shards, dt._spec, requires_grad=False)


def add_row_offsets(entries: Mapping[str, Entry]) -> dict[str, Any]:
    """Every value of ``entries``, with row-sharded DTensors that need it rebuilt over
    ``RowShards`` (see the module note). Collective only as ``resolve_row_layouts``."""
    layouts = resolve_row_layouts(entries)
    out: dict[str, Any] = {}
    for key, (value, _partition, _tp) in entries.items():
        layout = layouts.get(key)
        out[key] = value if layout is None or value.numel() == 0 else with_offset(value, layout)
    return out


def strip_row_offsets(value: Any) -> Any:
    """``value`` (recursively through dicts and lists) with every DTensor over
    ``RowShards`` turned back into one over its plain local tensor, the same storage:
    what optimizers and ``load_state_dict`` can compute with."""
    if isinstance(value, DTensor):
        local = value._local_tensor
        if isinstance(local, LocalShardsWrapper):
            return DTensor.from_local(
                local.local_shards()[0],
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        return value
    if isinstance(value, Mapping):
        return {k: strip_row_offsets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [strip_row_offsets(v) for v in value]
    return value
