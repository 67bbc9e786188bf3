"""Megatron-FSDP's uneven-DTensor helpers (``fsdp.uneven_dtensor``) at world size 2,
on a 7x3 tensor split 5/2 rows (not ``torch.chunk``'s 4/3) and on a
``distribute_tensor`` (chunk) one: measured chunk metadata, full tensors, splits, a
``dcp.save``/``dcp.load`` round trip of a preprocessed state dict (uneven to uneven and
uneven to chunk), and ``fully_shard(preproc_state_dict_for_dcp_ckpt=...)``."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fsdp_mesh.testing import run_distributed

FULL = torch.arange(21, dtype=torch.float32).reshape(7, 3)
ROWS = (5, 2)  # rank 0 holds rows 0..4, rank 1 rows 5..6


def _uneven(mesh, full: torch.Tensor = FULL) -> DTensor:
    rank = dist.get_rank()
    start = sum(ROWS[:rank])
    local = full[start : start + ROWS[rank]].clone()
    return DTensor.from_local(
        local, mesh, [Shard(0)], shape=full.shape, stride=full.stride(), run_check=False
    )


def _helpers(root: str) -> dict:
    from fsdp import uneven_dtensor as ud

    mesh = init_device_mesh("cpu", (2,))
    out: dict = {}
    dt = _uneven(mesh)
    meta = ud.gather_and_compute_chunk_metadata(dt)
    out["meta"] = (tuple(meta.offsets), tuple(meta.sizes))
    out["full"] = ud.uneven_dtensor_to_full_tensor(_uneven(mesh))
    out["replicated"] = ud.redistribute_uneven_dtensor_to_replicated(_uneven(mesh)).to_local()
    chunk = distribute_tensor(FULL, mesh, [Shard(0)])
    out["chunk_meta"] = tuple(ud.gather_and_compute_chunk_metadata(chunk).offsets)
    out["chunk_full"] = ud.uneven_dtensor_to_full_tensor(chunk)
    for name, sections in (("sections", [3, 4]), ("size", 3)):
        pieces = list(ud.split_dtensor(_uneven(mesh), sections, dim=0))
        out[name] = [
            (tuple(p.shape), tuple(p.to_local().shape), ud.uneven_dtensor_to_full_tensor(p))
            for p in pieces
        ]
    cols = list(
        ud.split_dtensor(_uneven(mesh), [1, 2], dim=1, update_uneven_dtensor_chunk_meta=True)
    )
    out["cols"] = [ud.uneven_dtensor_to_full_tensor(p) for p in cols]

    # DCP: an uneven state dict saved, loaded into uneven zeros and into chunk zeros.
    state = {"a": {"w": _uneven(mesh)}, "step": 3}
    ud.preprocess_state_dict_for_uneven_dtensor(state)
    dcp.save(state, checkpoint_id=root)
    target = {"a": {"w": _uneven(mesh, torch.zeros(7, 3))}, "step": 0}
    ud.preprocess_state_dict_for_uneven_dtensor(target)
    dcp.load(target, checkpoint_id=root)
    out["loaded_uneven"] = target["a"]["w"].to_local()
    chunk_target = {"a": {"w": distribute_tensor(torch.zeros(7, 3), mesh, [Shard(0)])}}
    dcp.load(chunk_target, checkpoint_id=root)
    out["loaded_chunk"] = chunk_target["a"]["w"].full_tensor()
    return out


def test_uneven_dtensor_helpers(tmp_path):
    import fsdp.uneven_dtensor
    from fsdp_ckpt import uneven_dtensor

    assert fsdp.uneven_dtensor.split_dtensor is uneven_dtensor.split_dtensor
    results = run_distributed(_helpers, 2, args=(str(tmp_path / "ckpt"),), timeout=120)
    for rank, out in enumerate(results):
        start = sum(ROWS[:rank])
        assert out["meta"] == ((start, 0), (ROWS[rank], 3)), out["meta"]
        assert out["chunk_meta"] == ((0, 0), (4, 0))[rank]
        for key in ("full", "replicated", "chunk_full", "loaded_chunk"):
            assert torch.equal(out[key], FULL), key
        for key, bounds in (("sections", [0, 3, 7]), ("size", [0, 3, 6, 7])):
            assert len(out[key]) == len(bounds) - 1, key
            for (shape, local_shape, full), lo, hi in zip(
                out[key], bounds[:-1], bounds[1:], strict=True
            ):
                assert shape == (hi - lo, 3), key
                mine = max(0, min(hi, start + ROWS[rank]) - max(lo, start))
                assert local_shape == (mine, 3), (key, lo, hi, local_shape)
                assert torch.equal(full, FULL[lo:hi]), (key, lo, hi)
        assert torch.equal(out["cols"][0], FULL[:, :1]) and torch.equal(out["cols"][1], FULL[:, 1:])
        assert torch.equal(out["loaded_uneven"], FULL[start : start + ROWS[rank]])
