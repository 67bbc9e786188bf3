"""The file names a manifest lists are confined to the checkpoint directory: a name
that is absolute or leaves the directory (``..``, or a symlink that resolves outside)
is refused with ``CorruptCheckpointError`` without being opened, and only regular files
are read (``/dev/zero`` or a FIFO would make the reader wait forever). By
``load_checkpoint`` on every rank, and by ``fsdp-consolidate``."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp_ckpt import CorruptCheckpointError, load_checkpoint, save_checkpoint
from fsdp_ckpt.cli import main as consolidate_main
from fsdp_ckpt.manifest import MANIFEST_NAME
from fsdp_mesh.testing import run_distributed


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _list_in_manifest(ckpt: Path, name: str, target: Path | None) -> None:
    """Add ``name`` to the manifest, with the size and CRC-32 of ``target`` (so that
    only its place, not its content, can give it away)."""
    payload = json.loads((ckpt / MANIFEST_NAME).read_text())
    data = target.read_bytes() if target is not None and target.is_file() else b""
    payload["files"][name] = len(data)
    payload["crc32"][name] = zlib.crc32(data)
    (ckpt / MANIFEST_NAME).write_text(json.dumps(payload))


def _bad_checkpoints(root: Path) -> dict[str, tuple[Path, str]]:
    """kind -> (checkpoint, the name the error must give)."""
    outside = root / "outside.bin"
    outside.write_bytes(b"not a checkpoint file")
    out: dict[str, tuple[Path, str]] = {}
    for kind in ("dotdot", "absolute", "dev_zero", "symlink_out", "fifo"):
        ckpt = root / kind
        save_checkpoint(ckpt, _mlp(0))
        if kind == "dotdot":
            name = "../outside.bin"
            _list_in_manifest(ckpt, name, outside)
        elif kind == "absolute":
            name = str(outside)
            _list_in_manifest(ckpt, name, outside)
        elif kind == "dev_zero":
            name = "/dev/zero"
            _list_in_manifest(ckpt, name, None)
        elif kind == "symlink_out":
            name = "extra/link.bin"
            (ckpt / name).symlink_to(outside)
            _list_in_manifest(ckpt, name, outside)
        else:
            name = "extra/pipe"
            os.mkfifo(ckpt / name)
            _list_in_manifest(ckpt, name, None)
        out[kind] = (ckpt, name)
    return out


def _load_each(cases: dict[str, tuple[str, str]]) -> dict[str, str]:
    got = {}
    for kind, (ckpt, _name) in cases.items():
        try:
            load_checkpoint(ckpt, _mlp(1))
            got[kind] = "loaded"
        except CorruptCheckpointError as exc:
            got[kind] = str(exc)
    return got


def test_load_refuses_names_outside_the_directory_and_special_files(tmp_path):
    cases = {k: (str(c), n) for k, (c, n) in _bad_checkpoints(tmp_path).items()}
    # a read of /dev/zero or a FIFO would hang: the harness turns that into a failure
    got = run_distributed(_load_each, 2, args=(cases,), timeout=60)
    assert got[0] == got[1], got
    for kind, (_ckpt, name) in cases.items():
        message = got[0][kind]
        assert name in message, (kind, message)
        expected = "not a regular file" if kind == "fifo" else "outside the checkpoint directory"
        assert expected in message, (kind, message)


@pytest.mark.timeout(60)
def test_consolidate_refuses_names_outside_the_directory_and_special_files(tmp_path, capsys):
    for kind, (ckpt, name) in _bad_checkpoints(tmp_path).items():
        out = tmp_path / f"{kind}.pt"
        assert consolidate_main([str(ckpt), str(out)]) == 1, kind
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("fsdp-consolidate: error: "), err
        assert name in err[0], (kind, err)
        assert not out.exists()
