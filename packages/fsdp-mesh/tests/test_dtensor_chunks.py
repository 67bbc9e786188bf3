"""``fsdp_mesh.dtensor_chunks.chunk_of`` / ``chunk_piece`` (DTensor's own ``torch.chunk``
pieces, no communication) at world size 2: they agree with what ``distribute_tensor``
holds and with the measured ``gather_and_compute_chunk_metadata`` on chunk pieces, on
``Shard(0)``, ``Shard(1)`` and a 2-D mesh of (Shard(0), Replicate)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from fsdp_mesh.dtensor_chunks import chunk_of, chunk_piece, gather_and_compute_chunk_metadata
from fsdp_mesh.testing import run_distributed

FULL = torch.arange(21, dtype=torch.float32).reshape(7, 3)


def _chunks() -> list:
    out = []
    for shape, placements in (
        ((2,), [Shard(0)]),
        ((2,), [Shard(1)]),
        ((2, 1), [Shard(0), Replicate()]),
    ):
        mesh = init_device_mesh("cpu", shape)
        dt = distribute_tensor(FULL, mesh, placements)
        chunk, measured = chunk_of(dt), gather_and_compute_chunk_metadata(dt)
        out.append(
            (
                (tuple(chunk.offsets), tuple(chunk.sizes)),
                (tuple(measured.offsets), tuple(measured.sizes)),
                torch.equal(chunk_piece(FULL, dt), dt.to_local()),
            )
        )
    with pytest.raises(ValueError, match="global shape"):
        chunk_piece(FULL[:6], dt)
    return out


def test_chunk_of_and_piece():
    expected = [
        [((0, 0), (4, 3)), ((0, 0), (7, 2)), ((0, 0), (4, 3))],
        [((4, 0), (3, 3)), ((0, 2), (7, 1)), ((4, 0), (3, 3))],
    ]
    for rank, out in enumerate(run_distributed(_chunks, 2, timeout=60)):
        for (chunk, measured, same), want in zip(out, expected[rank], strict=True):
            assert chunk == want
            assert measured == want
            assert same
