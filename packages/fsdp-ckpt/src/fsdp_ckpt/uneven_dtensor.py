"""Megatron-FSDP's uneven-DTensor helpers (``megatron_fsdp.uneven_dtensor``), for code
written against it; also ``fsdp.uneven_dtensor``.

They work on DTensors whose local tensors are any split of the global one along each
sharded dim, in rank order (not only ``torch.chunk`` pieces): the offsets are measured
by gathering the local shapes (``fsdp_mesh.dtensor_chunks``). Every function is a
collective over the DTensor's mesh.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp_mesh.dtensor_chunks import (
    gather_and_compute_chunk_metadata,
    preprocess_state_dict_for_uneven_dtensor,
    update_uneven_dtensor_chunk_metadata,
)

__all__ = [
    "gather_and_compute_chunk_metadata",
    "gather_uneven_dtensor_to_full_tensor",
    "preprocess_state_dict_for_uneven_dtensor",
    "redistribute_uneven_dtensor_to_replicated",
    "split_dtensor",
    "uneven_dtensor_to_full_tensor",
    "update_uneven_dtensor_chunk_metadata",
]


def uneven_dtensor_to_full_tensor(dtensor: DTensor) -> torch.Tensor:
    """The whole tensor on every rank, from local tensors of any sizes (a collective).
    Attaches chunk metadata to ``dtensor`` first if it has none, as Megatron-FSDP does."""
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"Input must be a DTensor, got {type(dtensor).__name__}.")
    if not hasattr(dtensor._local_tensor, "__create_chunk_list__"):
        update_uneven_dtensor_chunk_metadata(dtensor)
    chunks = dtensor.__create_chunk_list__()
    if len(chunks) != 1:
        raise ValueError(f"Expected exactly one chunk metadata per rank, got {len(chunks)}.")
    local = dtensor.to_local()
    # (shape, offset) of every piece gathered so far, and their elements, concatenated.
    pieces: list[tuple[torch.Size, tuple[int, ...]]] = [(local.shape, tuple(chunks[0].offsets))]
    flat = local.contiguous().view(-1)
    for mesh_dim, placement in enumerate(dtensor.placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, (Shard, _StridedShard)):
            raise ValueError(
                f"Unexpected placement {placement} at mesh dimension {mesh_dim}. "
                "Expected Shard, _StridedShard, or Replicate."
            )
        group = dtensor.device_mesh.get_group(mesh_dim)
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, pieces, group=group)
        counts = [sum(shape.numel() for shape, _ in theirs) for theirs in everyone]
        # Padded to the largest: not every backend (gloo) gathers unequal sizes.
        longest = max(counts)
        padded = flat.new_zeros(longest)
        padded[: flat.numel()] = flat
        bufs = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(bufs, padded, group=group)
        pieces = [piece for theirs in everyone for piece in theirs]
        flat = torch.cat([buf[:n] for buf, n in zip(bufs, counts, strict=True)])
    full = torch.zeros(dtensor.shape, dtype=local.dtype, device=local.device)
    start = 0
    for shape, offset in pieces:
        n = shape.numel()
        where = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
        full[where] = flat[start : start + n].view(shape)
        start += n
    return full


def redistribute_uneven_dtensor_to_replicated(dtensor: DTensor) -> DTensor:
    """The whole tensor as a replicated DTensor on ``dtensor``'s mesh."""
    return DTensor.from_local(
        uneven_dtensor_to_full_tensor(dtensor),
        device_mesh=dtensor.device_mesh,
        placements=[Replicate()] * len(dtensor.placements),
    )


def gather_uneven_dtensor_to_full_tensor(dtensor: DTensor) -> DTensor:
    """Deprecated in Megatron-FSDP: ``redistribute_uneven_dtensor_to_replicated``."""
    return redistribute_uneven_dtensor_to_replicated(dtensor)


def split_dtensor(
    dtensor: DTensor,
    split_size_or_sections: int | list[int],
    dim: int = 0,
    update_uneven_dtensor_chunk_meta: bool = False,
) -> Iterator[DTensor]:
    """``torch.split`` of a DTensor along ``dim`` without communication of data: each
    piece is a DTensor with the same placements whose local tensor is the part of this
    rank's local tensor inside the piece (possibly empty). Pieces of a DTensor with
    uneven local tensors stay uneven: pass ``update_uneven_dtensor_chunk_meta=True``
    to attach their measured chunk metadata (for DCP)."""
    size = dtensor.shape[dim]
    if isinstance(split_size_or_sections, int):
        if split_size_or_sections <= 0:
            raise ValueError(f"split size must be positive, got {split_size_or_sections}")
        bounds = [*range(0, size, split_size_or_sections), size]
    else:
        bounds = [0]
        for section in split_size_or_sections:
            bounds.append(bounds[-1] + section)
        if bounds[-1] != size:
            raise ValueError(
                f"split sections {list(split_size_or_sections)} sum to {bounds[-1]}, but "
                f"dim {dim} of the DTensor has size {size}"
            )
    chunk = gather_and_compute_chunk_metadata(dtensor)
    mine_start = chunk.offsets[dim]
    mine_stop = mine_start + chunk.sizes[dim]
    local = dtensor.to_local()
    for lo, hi in itertools.pairwise(bounds):
        start, stop = max(lo, mine_start), min(hi, mine_stop)
        piece = (
            local.narrow(dim, start - mine_start, stop - start)
            if start < stop
            else (local.narrow(dim, 0, 0))
        )
        shape = list(dtensor.shape)
        shape[dim] = hi - lo
        out = DTensor.from_local(
            piece,
            device_mesh=dtensor.device_mesh,
            placements=dtensor.placements,
            shape=torch.Size(shape),
            stride=piece.stride(),
        )
        if update_uneven_dtensor_chunk_meta:
            update_uneven_dtensor_chunk_metadata(out)
        yield out
