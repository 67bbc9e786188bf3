"""Every checkpoint failure is a ``CheckpointError`` (an ``Exception``) on every rank,
so the usual ``except Exception:`` around a periodic save catches it: torch's
``CheckpointException`` (a ``BaseException``) from DCP is raised as its ``__cause__``;
a missing checkpoint is a ``CheckpointError`` that is also a ``FileNotFoundError``.
``fsdp-consolidate`` exits 1 with one ``fsdp-consolidate: error: ...`` line and leaves
nothing behind."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import fsdp_ckpt.checkpoint as checkpoint_module
from fsdp_ckpt import CheckpointError, load_checkpoint, save_checkpoint
from fsdp_ckpt.cli import main as consolidate_main
from fsdp_ckpt.manifest import MANIFEST_NAME
from fsdp_hooks import fully_shard
from fsdp_mesh.testing import run_distributed


def _wrapped(seed: int):
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    return fully_shard(
        module, torch.optim.AdamW(module.parameters(), lr=1e-2), fsdp_unit_modules=[nn.Linear]
    )


class _FullDisk(FileSystemWriter):
    def write_data(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")


class _LostFile(FileSystemReader):
    def read_data(self, plan, planner):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "__1_0.distcp")


def _caught(fn) -> str:
    try:
        fn()
    except Exception as exc:  # what a training loop's periodic save catches
        cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else None
        return f"{type(exc).__name__} ({isinstance(exc, CheckpointError)}, {cause}): {exc}"
    return "no error"


def _save_and_load_failures(root: str) -> dict[str, str]:
    model, opt = _wrapped(0)
    root_path = Path(root)
    got = {}
    checkpoint_module.FileSystemWriter = _FullDisk
    try:
        got["save"] = _caught(lambda: save_checkpoint(root_path / "full", model, opt))
    finally:
        checkpoint_module.FileSystemWriter = FileSystemWriter
    dist.barrier()
    got["left"] = str(sorted(p.name for p in root_path.iterdir()))
    save_checkpoint(root_path / "good", model, opt)
    checkpoint_module.FileSystemReader = _LostFile
    try:
        got["load"] = _caught(lambda: load_checkpoint(root_path / "good", model, opt))
    finally:
        checkpoint_module.FileSystemReader = FileSystemReader
    got["missing"] = _caught(lambda: load_checkpoint(root_path / "nothing_here", model, opt))
    try:
        load_checkpoint(root_path / "nothing_here", model, opt)
    except FileNotFoundError:  # what code written before still catches
        got["missing_is_file_not_found"] = "yes"
    return got


def test_dcp_failures_are_checkpoint_errors_on_every_rank(tmp_path):
    got = run_distributed(_save_and_load_failures, 2, args=(str(tmp_path),), timeout=90)
    assert got[0] == got[1], got
    got = got[0]
    assert got["save"].startswith("CheckpointError (True, CheckpointException): "), got
    assert "No space left on device" in got["save"], got
    assert got["left"] == "[]", got  # the staging directory is removed
    assert got["load"].startswith("CheckpointError (True, CheckpointException): "), got
    assert "__1_0.distcp" in got["load"], got
    assert "(True, None)" in got["missing"] and "no checkpoint at" in got["missing"], got
    assert got["missing_is_file_not_found"] == "yes"


# ---- fsdp-consolidate -----------------------------------------------------------------
def _checkpoint(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)))
    return ckpt


def _version_1_with_damaged_metadata(ckpt: Path) -> None:
    payload = json.loads((ckpt / MANIFEST_NAME).read_text())
    del payload["crc32"]  # version 1: sizes only, so the damage is not seen by checksum
    payload["format_version"] = 1
    (ckpt / MANIFEST_NAME).write_text(json.dumps(payload))
    data = bytearray((ckpt / ".metadata").read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4] = b"\xff\xfe\xfd\xfc"
    (ckpt / ".metadata").write_bytes(bytes(data))


def _tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


@pytest.mark.parametrize("case", ["damaged_v1", "output_is_a_directory", "missing_hf_config"])
def test_consolidate_errors_are_one_line_and_leave_nothing(tmp_path, capsys, case):
    ckpt = _checkpoint(tmp_path)
    args = [str(ckpt), str(tmp_path / "out.pt")]
    if case == "damaged_v1":
        _version_1_with_damaged_metadata(ckpt)
    elif case == "output_is_a_directory":
        (tmp_path / "out.pt").mkdir()
    else:
        pytest.importorskip("transformers")
        args = [str(ckpt), str(tmp_path / "hf_out"), "--hf", str(tmp_path / "no_such_config")]
    before = _tree(tmp_path)
    assert consolidate_main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fsdp-consolidate: error: "), err
    assert _tree(tmp_path) == before  # no stray temporary file, no partial output


def test_consolidate_cli_entry_point_exits_1(tmp_path):
    """The installed command, as a user runs it: exit status 1, one line, no traceback."""
    import subprocess
    import sys

    ckpt = _checkpoint(tmp_path)
    _version_1_with_damaged_metadata(ckpt)
    exe = shutil.which("fsdp-consolidate") or sys.executable
    cmd = [exe] if exe != sys.executable else [exe, "-m", "fsdp_ckpt.cli"]
    done = subprocess.run(
        [*cmd, str(ckpt), str(tmp_path / "out.pt")], capture_output=True, text=True
    )
    assert done.returncode == 1, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fsdp-consolidate: error: "), done.stderr
