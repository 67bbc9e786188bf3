"""Where each rank's local piece of a DTensor lies, measured rather than assumed.

Megatron-FSDP's checkpoint preprocessing (``megatron_fsdp.uneven_dtensor``): the offset
of this rank's local tensor is the sum of the local sizes of the ranks before it on
each sharded mesh dim (gathered, so it holds for any split, even or not), and
``update_uneven_dtensor_chunk_metadata`` makes ``torch.distributed.checkpoint`` write
and read the local tensor at that offset. fsdp's DTensors are ``torch.chunk`` pieces,
so this agrees with the DTensor metadata; it is kept for code written against
Megatron-FSDP and for DTensors built elsewhere. Lives at the bottom layer so that
``fully_shard`` (``preproc_state_dict_for_dcp_ckpt``) and ``fsdp_ckpt.uneven_dtensor``
share it. Every function here is a collective over the DTensor's mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = [
    "gather_and_compute_chunk_metadata",
    "preprocess_state_dict_for_dcp",
    "preprocess_state_dict_for_uneven_dtensor",
    "update_uneven_dtensor_chunk_metadata",
]


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
    local_shape = tuple(dtensor.to_local().shape)
    offsets = [0] * len(local_shape)
    covered = list(local_shape)  # the extent gathered so far, per tensor dim
    for mesh_dim in _shard_mesh_dims(dtensor):
        placement = dtensor.placements[mesh_dim]
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard):  # _StridedShard is a Shard
            raise ValueError(
                f"unsupported placement {placement} on mesh dim {mesh_dim} of a DTensor "
                f"of shape {tuple(dtensor.shape)}; expected Shard, _StridedShard or Replicate"
            )
        group = dtensor.device_mesh.get_group(mesh_dim)
        shapes: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(shapes, covered, group=group)
        dim, rank = placement.dim, dist.get_rank(group)
        offsets[dim] += sum(s[dim] for s in shapes[:rank])
        covered[dim] = sum(s[dim] for s in shapes)
    return ChunkStorageMetadata(offsets=tuple(offsets), sizes=local_shape)


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
    chunk = gather_and_compute_chunk_metadata(dtensor)
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


def _one_split_per_dim(dtensor: DTensor) -> bool:
    dims = [p.dim for p in dtensor.placements if isinstance(p, Shard)]
    return len(dims) == len(set(dims))


def preprocess_state_dict_for_dcp(state_dict: dict) -> dict:
    """``preprocess_state_dict_for_uneven_dtensor`` for ``fully_shard``'s
    ``preproc_state_dict_for_dcp_ckpt``, on the DTensors whose every tensor dim is split
    by at most one mesh dim. Megatron-FSDP's offset sum takes the last mesh dim as the
    outermost split, where DTensor takes the first; for a dim split twice the measured
    offsets would then contradict the data, so those keep DTensor's own metadata."""
    return _preprocess(state_dict, _one_split_per_dim)


def preprocess_state_dict_for_uneven_dtensor(state_dict: dict) -> dict:
    """``update_uneven_dtensor_chunk_metadata`` on every DTensor of a (nested) state
    dict, in sorted key order; returns ``state_dict`` (changed in place). A collective:
    every rank must hold DTensors under the same keys (checked; a clear error on every
    rank otherwise)."""
    return _preprocess(state_dict, lambda _dtensor: True)


def _preprocess(state_dict: dict, accept: Callable[[DTensor], bool]) -> dict:
    paths = sorted(_dtensor_paths(state_dict, accept), key=lambda p: tuple(map(str, p)))
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, [tuple(map(str, p)) for p in paths])
        if any(other != everyone[0] for other in everyone):
            every = set.intersection(*(set(o) for o in everyone))
            odd = sorted({p for o in everyone for p in o} - every)
            raise ValueError(
                "ranks hold DTensors under different state-dict keys, so their chunk "
                f"metadata cannot be gathered together; keys not on every rank: {odd[:5]}"
            )
    for path in paths:
        value: Any = state_dict
        for key in path:
            value = value[key]
        update_uneven_dtensor_chunk_metadata(value)
    return state_dict
