"""Atomic saves, manifests, damaged checkpoints and mismatches: a rank killed during a
save leaves the previous checkpoint loadable and the partial one refused; truncated
files, missing manifests, and missing/unexpected/misshapen keys are errors that name
what is wrong, the same error on every rank of a ZeRO-3 model at world sizes 2 and 4.
Those two run on several ranks; the rest in this process (no process group)."""

from __future__ import annotations

import itertools
import os
import random
import shutil
import signal
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

from fsdp_ckpt import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    load_checkpoint,
    load_full_state_dict,
    save_checkpoint,
)
from fsdp_ckpt.atomic import incomplete_dir, old_dir
from fsdp_ckpt.cli import main as consolidate_main
from fsdp_ckpt.manifest import MANIFEST_NAME
from fsdp_hooks import fully_shard
from fsdp_mesh.testing import DistributedTestError, run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig

CFG = GPTConfig()


def _gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def _mlp(seed: int, *dims: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(dims)))


def _equal(a: nn.Module, b: nn.Module) -> bool:
    sb = b.state_dict()
    return all(torch.equal(v, sb[k]) for k, v in a.state_dict().items())


# ---- a rank killed during a save ---------------------------------------------------------
def _die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def _save_then_die_saving_again(path: str) -> None:
    module = _gpt(0)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    model, opt = fully_shard(module, opt, fsdp_unit_modules=[Block], zero_dp_strategy=3)
    save_checkpoint(path, model, opt, extra={"step": 0})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if dist.get_rank() == 1:
        FileSystemWriter.write_data = _die  # this process only: it is about to die
    save_checkpoint(path, model, opt, extra={"step": 1})


def test_rank_killed_during_save_keeps_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_save_then_die_saving_again, 2, args=(str(path),), timeout=60)
    assert 1 in info.value.failed_ranks
    partial = incomplete_dir(path)
    assert partial.is_dir() and not (partial / MANIFEST_NAME).exists()

    module = _gpt(5)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    assert load_checkpoint(path, module, opt) == {"step": 0}
    assert _equal(module, _gpt(0))  # the first save, not the +1 of the killed one
    with pytest.raises(IncompleteCheckpointError, match=MANIFEST_NAME):
        load_checkpoint(partial, _gpt(5))

    # The next save clears the leftovers and replaces the checkpoint.
    save_checkpoint(path, _gpt(6), extra={"step": 2})
    assert not partial.exists() and not old_dir(path).exists()
    module = _gpt(5)
    assert load_checkpoint(path, module) == {"step": 2}
    assert _equal(module, _gpt(6))


# ---- bad checkpoints on every rank -------------------------------------------------------
def _wrapped_mlp(seed: int, *dims: int):
    module = _mlp(seed, *dims)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    return fully_shard(module, opt, fsdp_unit_modules=[nn.Linear], zero_dp_strategy=3)


def _errors_on_every_rank(path: str) -> dict[str, tuple[str, str]]:
    """Load a ZeRO-3 checkpoint into mismatched models, then a damaged one; return the
    error each attempt raised here (type, message), for comparison across ranks."""
    save_checkpoint(path, *_wrapped_mlp(0, 4, 3, 2))
    attempts = {
        "missing": (4, 3, 2, 2),
        "unexpected": (4, 3),
        "misshapen": (4, 5, 2),
    }
    errors: dict[str, tuple[str, str]] = {}
    for what, dims in attempts.items():
        try:
            load_checkpoint(path, *_wrapped_mlp(1, *dims))
        except Exception as e:  # reported to the parent
            errors[what] = (type(e).__name__, str(e))
    dist.barrier()
    if dist.get_rank() == 0:
        shard = max(Path(path).glob("*.distcp"), key=lambda f: f.stat().st_size)
        shard.write_bytes(shard.read_bytes()[:-1])
    dist.barrier()
    try:
        load_checkpoint(path, *_wrapped_mlp(1, 4, 3, 2))
    except Exception as e:
        errors["truncated"] = (type(e).__name__, str(e))
    return errors


@pytest.mark.parametrize("world_size", [2, 4])
def test_bad_checkpoints_raise_the_same_error_on_every_rank(tmp_path, world_size):
    results = run_distributed(
        _errors_on_every_rank, world_size, args=(str(tmp_path / "ckpt"),), timeout=120
    )
    expected = {
        "missing": ("CheckpointMismatchError", "missing from the checkpoint: model.2.bias"),
        "unexpected": ("CheckpointMismatchError", "in the checkpoint but not here: model.1."),
        "misshapen": ("CheckpointMismatchError", "model.0.weight (checkpoint (3, 4), here (5, 4))"),
        "truncated": ("CorruptCheckpointError", "bytes"),
    }
    for rank, errors in enumerate(results):
        assert errors == results[0], f"rank {rank} differs from rank 0"
    assert set(results[0]) == set(expected)
    for what, (kind, fragment) in expected.items():
        assert results[0][what][0] == kind, (what, results[0][what])
        assert fragment in results[0][what][1], (what, results[0][what][1])


# ---- one process -------------------------------------------------------------------------
def test_replace_and_interrupted_replacement(tmp_path):
    path = tmp_path / "ckpt"
    save_checkpoint(path, _mlp(0, 4, 3), extra={"v": 0})
    save_checkpoint(path, _mlp(1, 4, 3), extra={"v": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    module = _mlp(9, 4, 3)
    assert load_checkpoint(path, module) == {"v": 1}
    assert _equal(module, _mlp(1, 4, 3))

    # Killed between "rename the old one aside" and "rename the new one in".
    path.rename(old_dir(path))
    assert load_checkpoint(path, module) == {"v": 1}
    save_checkpoint(path, _mlp(2, 4, 3), extra={"v": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert load_checkpoint(path, module) == {"v": 2}
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path / "nothing", module)


def test_damaged_checkpoints_are_refused(tmp_path):
    path = tmp_path / "ckpt"
    save_checkpoint(path, _mlp(0, 4, 3))
    shard = next(path.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[:-1])
    with pytest.raises(CorruptCheckpointError, match=f"{shard.name}: {len(data) - 1} bytes"):
        load_checkpoint(path, _mlp(1, 4, 3))
    shard.unlink()
    with pytest.raises(CorruptCheckpointError, match=f"{shard.name}: missing"):
        load_checkpoint(path, _mlp(1, 4, 3))

    save_checkpoint(path, _mlp(0, 4, 3))
    (path / MANIFEST_NAME).unlink()
    with pytest.raises(IncompleteCheckpointError, match="interrupted save"):
        load_checkpoint(path, _mlp(1, 4, 3))


def test_mismatches_name_the_keys(tmp_path):
    path = tmp_path / "ckpt"
    saved = _mlp(0, 4, 3, 2)
    save_checkpoint(path, saved, torch.optim.SGD(saved.parameters(), lr=0.1))

    with pytest.raises(
        CheckpointMismatchError,
        match=r"missing from the checkpoint: model\.2\.bias, model\.2\.weight",
    ):
        load_checkpoint(path, _mlp(1, 4, 3, 2, 2))
    with pytest.raises(
        CheckpointMismatchError,
        match=r"in the checkpoint but not here: model\.1\.bias, model\.1\.weight",
    ):
        load_checkpoint(path, _mlp(1, 4, 3))
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(path, _mlp(1, 4, 5, 2))
    message = str(info.value)
    assert "model.0.weight (checkpoint (3, 4), here (5, 4))" in message
    assert "model.1.weight (checkpoint (2, 3), here (2, 5))" in message
    module = _mlp(1, 4, 3, 2)
    assert load_checkpoint(path, module, strict=True) == {}
    assert _equal(module, saved)

    # Optimizer state: an Adam checkpoint has keys an SGD-with-momentum one lacks.
    adam_path = tmp_path / "adam"
    module = _mlp(0, 4, 3)
    adam = torch.optim.Adam(module.parameters(), lr=0.1)
    module(torch.ones(1, 4)).sum().backward()
    adam.step()
    save_checkpoint(adam_path, module, adam)
    target = _mlp(1, 4, 3)
    with pytest.raises(CheckpointMismatchError, match=r"optim\.state\.0\.weight\.momentum_buffer"):
        load_checkpoint(
            adam_path, target, torch.optim.SGD(target.parameters(), lr=0.1, momentum=0.9)
        )
    save_checkpoint(tmp_path / "model_only", target)
    with pytest.raises(CheckpointMismatchError, match="holds no optimizer state"):
        load_checkpoint(
            tmp_path / "model_only", target, torch.optim.SGD(target.parameters(), lr=0.1)
        )


def test_extra_rng_and_unstepped_optimizer_round_trip(tmp_path):
    module = _mlp(0, 4, 3)
    opt = torch.optim.AdamW(module.parameters(), lr=0.5)  # never stepped: no state
    torch.manual_seed(123)
    random.seed(123)
    save_checkpoint(tmp_path / "c", module, opt, extra={"step": 7, "loader": [1, 2, 3]})
    expected = (torch.rand(3), random.random())
    torch.manual_seed(0)
    random.seed(0)
    target = _mlp(1, 4, 3)
    target_opt = torch.optim.AdamW(target.parameters(), lr=0.1)
    extra = load_checkpoint(tmp_path / "c", target, target_opt)
    assert extra == {"step": 7, "loader": [1, 2, 3]}
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert not target_opt.state and target_opt.param_groups[0]["lr"] == 0.5
    assert _equal(target, module)


def test_consolidate_cli(tmp_path, capsys):
    path = tmp_path / "ckpt"
    saved = _gpt(0)
    save_checkpoint(path, saved, torch.optim.AdamW(saved.parameters()))
    assert consolidate_main([str(path), str(tmp_path / "m.pt")]) == 0
    assert "wrote" in capsys.readouterr().out
    module = _gpt(1)
    module.load_state_dict(load_full_state_dict(tmp_path / "m.pt"))
    assert _equal(module, saved)

    shutil.copytree(path, tmp_path / "broken")
    (tmp_path / "broken" / MANIFEST_NAME).unlink()
    assert consolidate_main([str(tmp_path / "broken"), str(tmp_path / "x.pt")]) == 1
    assert "no fsdp_manifest.json" in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()

    # The installed command runs that same main(), in a safetensors file this time.
    (entry,) = entry_points(group="console_scripts", name="fsdp-consolidate")
    assert entry.value == "fsdp_ckpt.cli:main" and entry.load() is consolidate_main
    assert (Path(sys.executable).parent / "fsdp-consolidate").is_file()
    assert consolidate_main([str(path), str(tmp_path / "m.safetensors")]) == 0
    module = _gpt(1)
    module.load_state_dict(load_full_state_dict(tmp_path / "m.safetensors"))
    assert _equal(module, saved)
