"""Ranks given different checkpoint paths (a per-rank timestamp, a relative path under
different working directories) are refused with ``CheckpointError`` on every rank,
naming the ranks and their paths, before anything is written or read: a save would
otherwise publish rank 0's shards alone as a complete checkpoint (losing the others'),
and a load would check rank 1's files against rank 0's manifest."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fsdp_ckpt import CheckpointError, load_checkpoint, save_checkpoint
from fsdp_hooks import fully_shard
from fsdp_mesh.testing import run_distributed


def _wrapped(seed: int):
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    return fully_shard(
        module, torch.optim.AdamW(module.parameters(), lr=1e-2), fsdp_unit_modules=[nn.Linear]
    )


def _tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def _save_per_rank_path(root: str, relative: bool) -> str:
    model, opt = _wrapped(0)
    rank = dist.get_rank()
    if relative:  # the same relative path, different working directories
        work = Path(root) / f"work_{rank}"
        work.mkdir(exist_ok=True)
        os.chdir(work)
        path = "ckpt"
    else:  # a per-rank name (a timestamp taken on each rank)
        path = str(Path(root) / f"ckpt_{rank}")
    try:
        save_checkpoint(path, model, opt)
    except CheckpointError as exc:
        return str(exc)
    return "saved"


def test_save_with_paths_that_differ_across_ranks_is_refused(tmp_path):
    for relative in (False, True):
        root = tmp_path / ("relative" if relative else "named")
        root.mkdir()
        got = run_distributed(_save_per_rank_path, 2, args=(str(root), relative), timeout=60)
        assert got[0] == got[1] != "saved", got
        for rank in (0, 1):
            expected = root / (f"work_{rank}/ckpt" if relative else f"ckpt_{rank}")
            assert f"rank {rank}: {expected}" in got[0], got[0]
        # nothing was written: no checkpoint, no staging directory
        assert _tree(root) == (["work_0", "work_1"] if relative else []), _tree(root)


def _load_per_rank_path(root: str) -> str:
    rank = dist.get_rank()
    for seed in (0, 1):  # two good checkpoints of different weights
        model, opt = _wrapped(seed)
        save_checkpoint(Path(root) / f"step_{seed}", model, opt)
    model, opt = _wrapped(7)
    before = [p.to_local().clone() for p in model.parameters()]
    try:
        load_checkpoint(Path(root) / f"step_{rank}", model, opt)  # each picked "the latest"
    except CheckpointError as exc:
        unchanged = all(
            torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters(), strict=True)
        )
        return f"{type(exc).__name__} unchanged={unchanged}: {exc}"
    return "loaded"


def test_load_with_paths_that_differ_across_ranks_is_refused(tmp_path):
    got = run_distributed(_load_per_rank_path, 2, args=(str(tmp_path),), timeout=60)
    assert got[0] == got[1], got
    assert got[0].startswith("CheckpointError unchanged=True: "), got[0]
    assert "differ across ranks" in got[0] and "CRC" not in got[0], got[0]
    for rank in (0, 1):
        assert f"rank {rank}: {tmp_path / f'step_{rank}'}" in got[0], got[0]


def _same_directory_two_spellings(root: str) -> None:
    """The same directory reached through a symlink on one rank: agreed, saved once."""
    rank = dist.get_rank()
    path = Path(root) / ("real" if rank == 0 else "link") / "ckpt"
    model, opt = _wrapped(0)
    saved = [p.to_local().clone() for p in model.parameters()]
    save_checkpoint(path, model, opt, extra={"rank": rank})
    model, opt = _wrapped(3)
    extra = load_checkpoint(path, model, opt)
    assert extra == {"rank": rank}, extra
    for a, p in zip(saved, model.parameters(), strict=True):
        assert torch.equal(a, p.to_local())


def test_the_same_directory_through_a_symlink_is_one_path(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    run_distributed(_same_directory_two_spellings, 2, args=(str(tmp_path),), timeout=60)
    assert _tree(tmp_path / "real" / "ckpt")  # one checkpoint, in the real directory
