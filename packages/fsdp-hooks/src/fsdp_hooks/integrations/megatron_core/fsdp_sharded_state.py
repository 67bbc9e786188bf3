"""``FullyShardedDataParallel.sharded_state_dict()``: Megatron-Core's dist-checkpointing
description of a model whose parameters are fsdp's DTensors.

Megatron-Core's modules describe their own tensors (``MegatronModule.sharded_state_dict``:
keys, tensor-parallel offsets, layer offsets, replica ids); under fsdp the data of each
such ``ShardedTensor`` is a DTensor holding the whole (tensor-parallel-local) tensor as
``torch.chunk`` pieces over the data-parallel mesh. Each is replaced by a
``ShardedTensorFactory`` that

- at save/load (``build``) describes this rank's piece: the DTensor's local tensor, at
  the offset DTensor's metadata gives it inside the tensor Megatron-Core described
  (uneven pieces: ``axis_fragmentations=None``, which Megatron-Core's ``torch_dist``
  backend hands to torch DCP); where the DTensor is replicated over a mesh dim, only
  coordinate 0 of that dim is the main replica (the data-parallel part of Megatron-Core's
  ``replica_id``);
- after a load (``merge``) turns the loaded piece back into a DTensor with the
  parameter's mesh and placements, so ``model.load_state_dict(loaded)`` copies it as
  any DTensor state dict.

Megatron-Core is imported only when this runs (it is an optional client).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from fsdp_mesh.dtensor_chunks import chunk_of

__all__ = ["dtensor_sharded_state_dict"]


def _replica(dtensor: DTensor) -> int:
    """0 on the main replica: this rank's coordinate over the mesh dims the DTensor is
    replicated on (0 when it is sharded over all of them)."""
    coordinate = dtensor.device_mesh.get_coordinate()
    if coordinate is None:
        raise RuntimeError("sharded_state_dict: this rank is not in the parameter's mesh")
    index = 0
    for dim, placement in enumerate(dtensor.placements):
        if isinstance(placement, Replicate):
            index = index * dtensor.device_mesh.size(dim) + coordinate[dim]
    return index


def _with_replica(replica_id: Any, dp_replica: int) -> Any:
    # Megatron-Core's replica ids end with the data-parallel rank (or are that int).
    if isinstance(replica_id, tuple):
        return (*replica_id[:-1], dp_replica) if replica_id else (dp_replica,)
    return dp_replica


def _factory(sharded: Any, mapping: Any) -> Any:
    dtensor: DTensor = sharded.data
    described = tuple(sharded.local_shape)
    if tuple(dtensor.shape) != described:
        raise NotImplementedError(
            f"sharded_state_dict: {sharded.key}: Megatron-Core describes a {described} "
            f"tensor but fsdp's parameter is a DTensor of shape {tuple(dtensor.shape)} "
            "(split over a tensor-parallel mesh dim too); save state_dict() with "
            "torch.distributed.checkpoint instead"
        )
    mesh, placements = dtensor.device_mesh, dtensor.placements
    chunk = chunk_of(dtensor)
    local_shape, offset = tuple(chunk.sizes), tuple(chunk.offsets)
    prepend = sharded.prepend_axis_num
    global_offset = (
        *sharded.global_offset[:prepend],
        *(o + d for o, d in zip(sharded.global_offset[prepend:], offset, strict=True)),
    )
    replica_id = _with_replica(sharded.replica_id, _replica(dtensor))

    # Megatron-Core's torch_dist backend takes irregular grids only without prepended
    # axes (its layer axis): they become real axes of size 1 of the described piece.
    shape = (1,) * prepend + tuple(local_shape)

    def build(key: str, data: DTensor, replica: Any, flattened_range: Any) -> Any:
        if flattened_range is not None:
            raise NotImplementedError(f"sharded_state_dict: {key}: flattened ranges")
        return mapping.ShardedTensor(
            key,
            data.to_local().view(shape),
            data.dtype,
            shape,
            tuple(sharded.global_shape),
            global_offset,
            None,  # torch.chunk pieces: an irregular grid
            replica,
            0,
            sharded.allow_shape_mismatch,
        )

    def merge(loaded: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            loaded.view(tuple(local_shape)), mesh, placements, run_check=False,
            shape=dtensor.shape, stride=dtensor.stride(),
        )  # fmt: skip

    return mapping.ShardedTensorFactory(sharded.key, dtensor, build, merge, replica_id)


def dtensor_sharded_state_dict(state: Any) -> Any:
    """``state`` (a Megatron-Core sharded state dict, nested dicts and lists) with every
    ``ShardedTensor`` whose data is a DTensor replaced by a factory (see the module
    note); everything else is kept."""
    from megatron.core.dist_checkpointing import mapping

    def convert(x: Any) -> Any:
        if isinstance(x, mapping.ShardedTensor) and isinstance(x.data, DTensor):
            return _factory(x, mapping)
        return x

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return convert(x)

    return walk(state)
