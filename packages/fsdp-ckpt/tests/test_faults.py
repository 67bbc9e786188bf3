"""Checkpoints under user mistakes and damage: a save never deletes what is not an fsdp
checkpoint (or an empty directory), and a load refuses bytes that changed since the
save (per-file CRC-32 in the manifest), a damaged ``.metadata`` and a damaged extra
state file with ``CorruptCheckpointError`` naming the file, on every rank."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from fsdp_ckpt import CheckpointError, CorruptCheckpointError, load_checkpoint, save_checkpoint
from fsdp_ckpt.checksums import crc32_of
from fsdp_ckpt.manifest import MANIFEST_NAME, Manifest
from fsdp_mesh.testing import run_distributed

MARK = 1234.5625  # exactly representable: found by its bytes in the shard file


def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    with torch.no_grad():
        model[0].weight[1, 2] = MARK
    return model


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _user_files(root: Path) -> None:
    (root / "logs").mkdir(parents=True)
    (root / "train.py").write_text("print('training')\n")
    (root / "logs" / "metrics.csv").write_text("step,loss\n0,1.0\n")


# ---- a save never deletes other files ----------------------------------------------------
def test_save_refuses_a_directory_of_other_files(tmp_path, monkeypatch):
    work = tmp_path / "work"
    _user_files(work)
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointError, match=r"not an fsdp checkpoint.*not empty"):
        save_checkpoint(work, _mlp(0))
    assert _snapshot(tmp_path) == before
    monkeypatch.chdir(work)
    with pytest.raises(CheckpointError, match="not an fsdp checkpoint"):
        save_checkpoint(".", _mlp(0))
    with pytest.raises(CheckpointError, match="not an fsdp checkpoint"):
        save_checkpoint("logs/..", _mlp(0))
    assert _snapshot(tmp_path) == before  # nothing written next to it either


def test_save_refuses_a_file_and_a_checkpoint_holding_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not a directory"):
        save_checkpoint(tmp_path / "notes.txt", _mlp(0))
    assert (tmp_path / "notes.txt").read_text() == "keep me"

    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, _mlp(0))
    (ckpt / "README").write_text("which run this was")
    with pytest.raises(CheckpointError, match=r"does not list \(\['README'\]\)"):
        save_checkpoint(ckpt, _mlp(1))
    assert (ckpt / "README").read_text() == "which run this was"

    (ckpt / "README").unlink()
    (ckpt / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be read"):
        save_checkpoint(ckpt, _mlp(1))


def test_save_into_an_empty_directory_and_over_a_checkpoint(tmp_path):
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    save_checkpoint(empty, _mlp(0), extra={"v": 0})
    save_checkpoint(empty, _mlp(1), extra={"v": 1})  # replaces its own checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no leftovers
    module = _mlp(5)
    assert load_checkpoint(empty, module) == {"v": 1}
    expected = _mlp(1).state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in module.state_dict().items())


def _refusal_on_every_rank(path: str) -> str:
    try:
        save_checkpoint(path, _mlp(0))
    except CheckpointError as exc:
        return str(exc)
    return "saved"


def test_refusal_is_raised_on_every_rank(tmp_path):
    _user_files(tmp_path / "work")
    before = _snapshot(tmp_path)
    got = run_distributed(_refusal_on_every_rank, 2, args=(str(tmp_path / "work"),), timeout=60)
    assert got[0] == got[1] and "not an fsdp checkpoint" in got[0]
    assert _snapshot(tmp_path) == before


# ---- a load refuses changed bytes ---------------------------------------------------------
def _overwrite(path: Path, offset: int, new: bytes) -> None:
    data = bytearray(path.read_bytes())
    size = len(data)
    data[offset : offset + len(new)] = new
    assert len(data) == size
    path.write_bytes(bytes(data))


def _flip_marked_float(ckpt: Path) -> str:
    """Overwrite the float MARK inside its shard file, keeping the size; the name."""
    needle = struct.pack("<f", MARK)
    for shard in ckpt.glob("*.distcp"):
        at = shard.read_bytes().find(needle)
        if at >= 0:
            _overwrite(shard, at, struct.pack("<f", -MARK))
            return shard.name
    raise AssertionError("the marked float is in no shard file")


def test_a_changed_float_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, _mlp(0))
    name = _flip_marked_float(ckpt)
    with pytest.raises(CorruptCheckpointError, match=f"{name}: CRC-32 .* changed since the save"):
        load_checkpoint(ckpt, _mlp(1))


@pytest.mark.parametrize("damaged", [".metadata", "extra/rank_00000.pt"])
def test_damaged_metadata_and_extra_are_refused(tmp_path, damaged):
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, _mlp(0), extra={"step": 3})
    target = ckpt / damaged
    _overwrite(target, target.stat().st_size // 2, b"\xff\xfe\xfd\xfc")
    with pytest.raises(CorruptCheckpointError, match=f"{damaged}: CRC-32"):
        load_checkpoint(ckpt, _mlp(1))

    # Even with a manifest rewritten to match the damage: a clear error, not whatever
    # unpickling raises (UnicodeDecodeError, UnpicklingError).
    manifest = Manifest.read(ckpt)
    crcs = dict(manifest.checksums)
    crcs[damaged] = crc32_of(target)
    Manifest.of_directory(ckpt, world_size=1, has_optimizer=False, checksums=crcs).write(ckpt)
    with pytest.raises(CorruptCheckpointError, match="cannot read"):
        load_checkpoint(ckpt, _mlp(1))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_damaged_metadata_of_a_plain_dcp_checkpoint(tmp_path):
    dcp.save({"model": _mlp(0).state_dict()}, checkpoint_id=tmp_path / "plain", no_dist=True)
    target = tmp_path / "plain" / ".metadata"
    _overwrite(target, 0, b"\x00\x01\x02\x03")
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata"):
        load_checkpoint(tmp_path / "plain", _mlp(1))


def test_a_version_1_manifest_still_loads(tmp_path):
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, _mlp(0))
    payload = json.loads((ckpt / MANIFEST_NAME).read_text())
    del payload["crc32"]
    payload["format_version"] = 1
    (ckpt / MANIFEST_NAME).write_text(json.dumps(payload))
    module = _mlp(1)
    load_checkpoint(ckpt, module)
    assert module[0].weight[1, 2].item() == MARK


def _changed_float_on_every_rank(path: str) -> str:
    from fsdp_hooks import fully_shard

    module = _mlp(0)
    model, opt = fully_shard(
        module, torch.optim.AdamW(module.parameters()), fsdp_unit_modules=[nn.Linear]
    )
    save_checkpoint(path, model, opt)
    dist.barrier()
    if dist.get_rank() == 0:
        _flip_marked_float(Path(path))
    dist.barrier()
    module = _mlp(1)
    model, opt = fully_shard(
        module, torch.optim.AdamW(module.parameters()), fsdp_unit_modules=[nn.Linear]
    )
    try:
        load_checkpoint(path, model, opt)
    except CorruptCheckpointError as exc:
        return str(exc)
    return "loaded"


def test_a_changed_float_is_refused_on_every_rank(tmp_path):
    got = run_distributed(
        _changed_float_on_every_rank, 2, args=(str(tmp_path / "ckpt"),), timeout=90
    )
    assert got[0] == got[1] and "CRC-32" in got[0], got
