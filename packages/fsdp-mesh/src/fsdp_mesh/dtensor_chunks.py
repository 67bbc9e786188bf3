"""Where each rank's local piece of a DTensor lies, measured rather than assumed.

Megatron-FSDP's checkpoint preprocessing (``megatron_fsdp.uneven_dtensor``): the offset
of this rank's local tensor is the sum of the local sizes of the ranks before it on
each sharded mesh dim (gathered, so it holds for any split, even or not), and
``update_uneven_dtensor_chunk_metadata`` makes ``torch.distributed.checkpoint`` write
and read the local tensor at that offset. fsdp's DTensors are ``torch.chunk`` pieces,
so this agrees with the DTensor metadata; it is kept for code written against
Megatron-FSDP and for DTensors built elsewhere (``fsdp_ckpt.uneven_dtensor``). Every
function here is a collective over the DTensor's mesh, except ``chunk_of`` and
``chunk_piece``: where DTensor's contract puts the piece (no communication), the one
helper for every user that relies on that contract (checkpoint adapters, pretrained
loading, the chunk-size check before trusting DCP's own offsets).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = [
    "chunk_of",
    "chunk_piece",
    "gather_and_compute_chunk_metadata",
    "preprocess_state_dict_for_uneven_dtensor",
    "update_uneven_dtensor_chunk_metadata",
]


def chunk_of(dtensor: DTensor) -> ChunkStorageMetadata:
    """The offsets and sizes of this rank's local tensor as DTensor's contract gives
    them (``torch.chunk`` pieces of every ``Shard(d)``), without communication; a rank
    outside the mesh gets an empty chunk."""
    shape, offset = compute_local_shape_and_global_offset(
        dtensor.shape, dtensor.device_mesh, dtensor.placements
    )
    return ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(shape))


def chunk_piece(full: torch.Tensor, dtensor: DTensor) -> torch.Tensor:
    """This rank's piece (``chunk_of``) of ``full``, a tensor of ``dtensor``'s global
    shape: a view of ``full``."""
    if tuple(full.shape) != tuple(dtensor.shape):
        raise ValueError(
            f"chunk_piece: the full tensor has shape {tuple(full.shape)}, the DTensor's "
            f"global shape is {tuple(dtensor.shape)}; they must be equal"
        )
    if dtensor.device_mesh.get_coordinate() is None:
        raise ValueError("chunk_piece: this rank is not in the DTensor's mesh, so it has no piece")
    chunk = chunk_of(dtensor)
    piece = full
    for dim, (start, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
        piece = piece.narrow(dim, start, size)
    return piece


def _shard_mesh_dims(dtensor: DTensor) -> list[int]:
    """Mesh dims in the order their offsets are accumulated (Megatron-FSDP's order:
    the strided shard, if any, last)."""
    strided = [d for d, p in enumerate(dtensor.placements) if isinstance(p, _StridedShard)]
    if len(strided) > 1:
        raise ValueError(
            f"a DTensor with {len(strided)} strided shard placements is not supported "
            f"(placements {dtensor.placements}); at most one is"
        )
    others = [d for d in range(len(dtensor.placements)) if d not in strided]
    return others + strided


def gather_and_compute_chunk_metadata(dtensor: DTensor) -> ChunkStorageMetadata:
    """The offsets and sizes of this rank's local tensor in the global one, from the
    local shapes of the ranks on each sharded mesh dim (a collective)."""
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"expected a DTensor, got {type(dtensor).__name__}")
    return _gather_chunks([dtensor])[0]


def _gather_chunks(dtensors: list[DTensor]) -> list[ChunkStorageMetadata]:
    """``gather_and_compute_chunk_metadata`` of DTensors on one mesh with one set of
    placements, with one ``all_gather_object`` per sharded mesh dim for all of them."""
    first = dtensors[0]
    locals_ = [tuple(d.to_local().shape) for d in dtensors]
    offsets = [[0] * len(shape) for shape in locals_]
    covered = [list(shape) for shape in locals_]  # the extent gathered so far
    for mesh_dim in _shard_mesh_dims(first):
        placement = first.placements[mesh_dim]
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, (Shard, _StridedShard)):
            raise ValueError(
                f"unsupported placement {placement} on mesh dim {mesh_dim} of a DTensor "
                f"of shape {tuple(first.shape)}; expected Shard, _StridedShard or Replicate"
            )
        group = first.device_mesh.get_group(mesh_dim)
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, covered, group=group)
        dim, rank = placement.dim, dist.get_rank(group)
        for i in range(len(dtensors)):
            offsets[i][dim] += sum(theirs[i][dim] for theirs in everyone[:rank])
            covered[i][dim] = sum(theirs[i][dim] for theirs in everyone)
    return [
        ChunkStorageMetadata(offsets=tuple(off), sizes=shape)
        for off, shape in zip(offsets, locals_, strict=True)
    ]


def _write_items(chunk: ChunkStorageMetadata) -> Callable[[str, DTensor], list[WriteItem]]:
    def create(fqn: str, tensor: DTensor) -> list[WriteItem]:
        local = tensor.to_local()
        if local.numel() == 0:
            return []  # an empty piece writes nothing
        return [
            WriteItem(
                type=WriteItemType.SHARD,
                index=MetadataIndex(fqn, chunk.offsets),
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(local),
                    size=tensor.size(),
                ),
            )
        ]

    return create


def update_uneven_dtensor_chunk_metadata(dtensor: DTensor) -> None:
    """Make DCP place ``dtensor``'s local tensor at its measured offset (a collective):
    sets ``__create_chunk_list__`` and ``__create_write_items__`` on the local tensor,
    which ``DTensor`` consults first."""
    _attach(dtensor, gather_and_compute_chunk_metadata(dtensor))


def _attach(dtensor: DTensor, chunk: ChunkStorageMetadata) -> None:
    local = dtensor._local_tensor
    local.__create_chunk_list__ = lambda: [chunk]  # type: ignore[attr-defined]
    local.__create_write_items__ = _write_items(chunk)  # type: ignore[attr-defined]


def _dtensor_paths(tree: dict, accept: Callable[[DTensor], bool], path: tuple = ()) -> list[tuple]:
    found: list[tuple] = []
    for key, value in tree.items():
        if isinstance(value, dict):
            found += _dtensor_paths(value, accept, (*path, key))
        elif isinstance(value, DTensor) and accept(value):
            found.append((*path, key))
    return found


def _at(tree: dict, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def preprocess_state_dict_for_uneven_dtensor(state_dict: dict) -> dict:
    """``update_uneven_dtensor_chunk_metadata`` on every DTensor of a (nested) state
    dict, in sorted key order; returns ``state_dict`` (changed in place). A collective:
    every rank must hold DTensors under the same keys (checked; a clear error on every
    rank otherwise)."""
    return _preprocess(state_dict, lambda _dtensor: True)


def _preprocess(state_dict: dict, accept: Callable[[DTensor], bool]) -> dict:
    paths = sorted(_dtensor_paths(state_dict, accept), key=lambda p: tuple(map(str, p)))
    values = [_at(state_dict, path) for path in paths]
    world = dist.get_world_size() if dist.is_initialized() else 1
    # The key check spans the world only where every DTensor does (a model on part of
    # the world, e.g. one pipeline stage, must not wait for the others).
    if world > 1 and all(v.device_mesh.size() == world for v in values):
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, [tuple(map(str, p)) for p in paths])
        if any(other != everyone[0] for other in everyone):
            every = set.intersection(*(set(o) for o in everyone))
            odd = sorted({p for o in everyone for p in o} - every)
            raise ValueError(
                "ranks hold DTensors under different state-dict keys, so their chunk "
                f"metadata cannot be gathered together; keys not on every rank: {odd[:5]}"
            )
    # One gather per (mesh, placements) and sharded mesh dim, in the same order on
    # every rank (the paths are).
    batches: dict[tuple, list[DTensor]] = {}
    for value in values:
        batches.setdefault((value.device_mesh, tuple(value.placements)), []).append(value)
    for batch in batches.values():
        for dtensor, chunk in zip(batch, _gather_chunks(batch), strict=True):
            _attach(dtensor, chunk)
    return state_dict
