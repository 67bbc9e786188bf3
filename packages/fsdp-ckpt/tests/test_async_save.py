"""Asynchronous saves (``save_checkpoint(..., asynchronous=True)``, Note [asynchronous
save]): exact round trips under every strategy at world 2 with the optimizer stepping
while the files are written (the checkpoint holds the values of the call, and the save
never touches the live state); staging allocates nothing after the first save; a
background failure is raised by ``wait()`` and by the next call, on every rank, naming
the rank; a rank (or every rank) SIGKILLed at each phase leaves the previous checkpoint
loadable and verified and never a half-published one."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor

import fsdp_ckpt.checkpoint
from fsdp_ckpt import CheckpointError, SaveHandle, load_checkpoint, save_checkpoint
from fsdp_ckpt.async_save import process_saver
from fsdp_ckpt.atomic import incomplete_dir, old_dir
from fsdp_ckpt.manifest import MANIFEST_NAME, Manifest
from fsdp_ckpt.staging import HostStager, staging_bytes
from fsdp_hooks import fully_shard
from fsdp_mesh.testing import DistributedTestError, run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig

CFG = GPTConfig()
STRATEGIES = [0, 1, 2, 3]


def _wrapped(seed: int, strategy: int = 3):
    torch.manual_seed(seed)
    module = GPT(CFG)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    return fully_shard(module, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)


def _step(model, opt, step: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, CFG.vocab_size, (2 * world, 8), generator=g)[2 * rank : 2 * rank + 2]
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _full(value):
    if isinstance(value, DTensor):
        return value.full_tensor().clone()
    return value.clone() if torch.is_tensor(value) else value


def _snapshot(model, opt) -> dict:
    """Every value of the model and its optimizer, whole (a collective)."""
    out = {f"model.{k}": _full(v) for k, v in model.state_dict().items()}
    for pid, state in opt.state_dict()["state"].items():
        out.update({f"optim.{pid}.{k}": _full(v) for k, v in state.items()})
    return out


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if torch.is_tensor(value):
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
        else:
            assert got[key] == value, key


# ---- exact round trips while training goes on ------------------------------------------
_WRITE = FileSystemWriter.write_data
_STEPPED = threading.Event()


def _write_after_the_step(self, *args, **kwargs):
    """The background write, held until the main thread has stepped the optimizer."""
    assert threading.current_thread() is not threading.main_thread()
    assert _STEPPED.wait(60), "the training step never came"
    return _WRITE(self, *args, **kwargs)


def _round_trip_while_training(path: str, strategy: int) -> None:
    model, opt = _wrapped(0, strategy)
    twin, twin_opt = _wrapped(0, strategy)  # the same training, never saved
    for step in range(2):
        _step(model, opt, step)
        _step(twin, twin_opt, step)

    FileSystemWriter.write_data = _write_after_the_step
    handle = save_checkpoint(path, model, opt, extra={"step": 2}, asynchronous=True)
    assert isinstance(handle, SaveHandle)
    _step(model, opt, 2)  # while the save waits to write
    _step(twin, twin_opt, 2)
    assert not handle.done()
    _STEPPED.set()
    assert handle.wait(60) == Path(path)
    FileSystemWriter.write_data = _WRITE
    _assert_equal(_snapshot(model, opt), _snapshot(twin, twin_opt))  # the save changed nothing

    # A second save of the same state reuses every staging buffer.
    stager = process_saver().stager
    allocations, nbytes = stager.allocations, stager.nbytes
    save_checkpoint(path, model, opt, extra={"step": 3}, asynchronous=True).wait()
    assert (stager.allocations, stager.nbytes) == (allocations, nbytes)
    fresh, fresh_opt = _wrapped(1, strategy)
    assert load_checkpoint(path, fresh, fresh_opt) == {"step": 3}
    _assert_equal(_snapshot(fresh, fresh_opt), _snapshot(model, opt))


def _round_trip_first_save(path: str, strategy: int) -> None:
    """The values at the call of the first save, loaded back."""
    model, opt = _wrapped(0, strategy)
    for step in range(2):
        _step(model, opt, step)
    at_call = _snapshot(model, opt)
    FileSystemWriter.write_data = _write_after_the_step
    handle = save_checkpoint(path, model, opt, extra={"step": 2}, asynchronous=True)
    _step(model, opt, 2)
    _STEPPED.set()
    handle.wait(60)
    FileSystemWriter.write_data = _WRITE
    fresh, fresh_opt = _wrapped(1, strategy)
    assert load_checkpoint(path, fresh, fresh_opt) == {"step": 2}
    _assert_equal(_snapshot(fresh, fresh_opt), at_call)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_async_save_holds_the_values_of_the_call(tmp_path, strategy):
    run_distributed(_round_trip_first_save, 2, args=(str(tmp_path / "ckpt"), strategy))


@pytest.mark.parametrize("strategy", [1, 3])
def test_async_save_never_changes_training_and_reuses_staging(tmp_path, strategy):
    run_distributed(_round_trip_while_training, 2, args=(str(tmp_path / "ckpt"), strategy))


# ---- failures ----------------------------------------------------------------------------
def _disk_full(self, *args, **kwargs):
    raise OSError(28, "No space left on device (test)")


def _failure_on_every_rank(path: str) -> dict[str, str]:
    model, opt = _wrapped(0)
    _step(model, opt, 0)
    first = _snapshot(model, opt)
    save_checkpoint(path, model, opt, extra={"step": 1}, asynchronous=True).wait()
    _step(model, opt, 1)
    if dist.get_rank() == 1:
        FileSystemWriter.write_data = _disk_full
    handle = save_checkpoint(path, model, opt, extra={"step": 2}, asynchronous=True)
    seen: dict[str, str] = {}
    with pytest.raises(CheckpointError) as waited:
        handle.wait(60)
    seen["wait"] = str(waited.value)
    FileSystemWriter.write_data = _WRITE
    with pytest.raises(CheckpointError) as next_call:
        save_checkpoint(path, model, opt, asynchronous=True)
    seen["next"] = str(next_call.value)
    # The previous checkpoint is still there, verified; the next save goes through.
    fresh, fresh_opt = _wrapped(1)
    assert load_checkpoint(path, fresh, fresh_opt) == {"step": 1}
    _assert_equal(_snapshot(fresh, fresh_opt), first)
    save_checkpoint(path, model, opt, extra={"step": 3}, asynchronous=True).wait()
    assert load_checkpoint(path, fresh, fresh_opt) == {"step": 3}
    return seen


def test_background_failure_is_raised_by_wait_and_next_call_on_every_rank(tmp_path):
    got = run_distributed(_failure_on_every_rank, 2, args=(str(tmp_path / "ckpt"),), timeout=90)
    assert got[0] == got[1], got
    assert "rank 1: OSError" in got[0]["wait"] and "No space left" in got[0]["wait"]
    assert got[0]["next"].startswith("the previous asynchronous save")
    assert "rank 1: OSError" in got[0]["next"]


def _busy(path: str) -> str:
    model, opt = _wrapped(0)
    FileSystemWriter.write_data = _write_after_the_step
    handle = save_checkpoint(path, model, opt, asynchronous=True)
    try:
        save_checkpoint(path, model, opt, asynchronous=True, wait_for_previous=False)
    except CheckpointError as exc:
        message = str(exc)
    else:
        message = "saved"
    _STEPPED.set()
    handle.wait(60)
    FileSystemWriter.write_data = _WRITE
    return message


def test_no_wait_refuses_while_a_save_is_in_flight_on_every_rank(tmp_path):
    got = run_distributed(_busy, 2, args=(str(tmp_path / "ckpt"),), timeout=90)
    assert got[0] == got[1] and "still being written on rank(s) [0, 1]" in got[0], got


def _stage_fails_on_rank_1(path: str) -> str:
    model, opt = _wrapped(0)
    if dist.get_rank() == 1:

        def out_of_memory(self, state):
            raise RuntimeError("out of memory (test)")

        HostStager.stage = out_of_memory
    try:
        save_checkpoint(path, model, opt, asynchronous=True)
    except CheckpointError as exc:
        return str(exc)
    return "saved"


def test_staging_failure_on_one_rank_is_raised_on_every_rank(tmp_path):
    got = run_distributed(_stage_fails_on_rank_1, 2, args=(str(tmp_path / "ckpt"),), timeout=90)
    assert got[0] == got[1], got
    assert got[0].startswith("[rank 1] cannot copy") and "out of memory (test)" in got[0]
    assert not (tmp_path / "ckpt").exists()


def test_one_process_async_save_and_refusals(tmp_path):
    """No process group: the same path; a refused target raises at the call."""
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not an fsdp checkpoint"):
        save_checkpoint(tmp_path / "notes", module, asynchronous=True)
    assert (tmp_path / "notes" / "keep.txt").read_text() == "keep me"
    with pytest.raises(TypeError, match="asynchronous must be True or False; got 'yes'"):
        save_checkpoint(tmp_path / "ckpt", module, asynchronous="yes")
    assert not (tmp_path / "ckpt").exists()
    handle = save_checkpoint(tmp_path / "ckpt", module, extra={"v": 1}, asynchronous=True)
    want = {k: v.clone() for k, v in module.state_dict().items()}
    with torch.no_grad():
        module.weight.add_(1.0)
    handle.wait()
    loaded = torch.nn.Linear(4, 3)
    assert load_checkpoint(tmp_path / "ckpt", loaded) == {"v": 1}
    _assert_equal(dict(loaded.state_dict()), want)


def test_stager_copies_and_reuses(tmp_path):
    stager = HostStager()
    live = {"a": torch.arange(6.0).view(2, 3)[:, 1:], "groups": [{"lr": 0.1}]}
    staged = stager.stage(live)
    live["a"].add_(100.0)
    assert torch.equal(staged["a"], torch.tensor([[1.0, 2.0], [4.0, 5.0]]))
    assert stager.allocations == 1 and stager.nbytes == 4 * 4  # the view, not its base
    again = stager.stage(live)
    assert stager.allocations == 1 and again["a"].data_ptr() == staged["a"].data_ptr()
    # A tied weight (one memory under two names) is copied once, and stays tied.
    weight = torch.ones(3, 2)
    tied = stager.stage({"embed": weight, "head": weight.view(3, 2)})
    assert tied["embed"] is tied["head"] and stager.nbytes == 3 * 2 * 4
    assert staging_bytes({"embed": weight, "head": weight.view(3, 2)}) == 3 * 2 * 4


# ---- SIGKILL at each phase ---------------------------------------------------------------
def _die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


_RENAME = Path.rename


def _die_publishing(self, target):
    """Path.rename, but die before the new checkpoint is renamed into place (after
    the previous one was renamed aside)."""
    if self.name.endswith(".incomplete"):
        _die()
    return _RENAME(self, target)


def _kill_at(phase: str) -> None:
    if phase == "staging":
        HostStager.stage = _die
    elif phase == "writing":
        FileSystemWriter.write_data = _die
    elif phase == "checksumming":
        fsdp_ckpt.checkpoint.crc32_of_files = _die
    elif phase == "manifest":
        Manifest.write = _die
    elif phase == "publishing":
        Path.rename = _die_publishing
    else:
        raise ValueError(phase)


def _save_then_die_saving_again(path: str, phase: str, victims: list[int]) -> None:
    model, opt = _wrapped(0)
    save_checkpoint(path, model, opt, extra={"step": 0}, asynchronous=True).wait()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if dist.get_rank() in victims:
        _kill_at(phase)
    save_checkpoint(path, model, opt, extra={"step": 1}, asynchronous=True).wait(60)


@pytest.mark.parametrize(
    ("phase", "victims"),
    [
        ("staging", [1]),
        ("writing", [1]),
        ("writing", [0, 1]),
        ("checksumming", [1]),
        ("checksumming", [0, 1]),
        ("manifest", [0]),
        ("publishing", [0]),
    ],
)
def test_sigkill_at_each_phase_keeps_the_previous_checkpoint(tmp_path, phase, victims):
    path = tmp_path / "ckpt"
    with pytest.raises(DistributedTestError) as info:
        run_distributed(
            _save_then_die_saving_again, 2, args=(str(path), phase, victims), timeout=60
        )
    assert set(victims) <= set(info.value.failed_ranks)
    # Never a half-published checkpoint: the path (or, killed between the renames, its
    # .old) holds the first save, complete and verified.
    published = path if path.exists() else old_dir(path)
    assert (published / MANIFEST_NAME).is_file()
    module = GPT(CFG)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    assert load_checkpoint(path, module, opt) == {"step": 0}  # checksums verified
    torch.manual_seed(0)
    first = GPT(CFG).state_dict()
    for key, value in module.state_dict().items():
        torch.testing.assert_close(value, first[key], rtol=0, atol=0, msg=key)
    if phase == "publishing":  # complete but never published: not at the path
        assert (incomplete_dir(path) / MANIFEST_NAME).is_file()
    # The next save clears the leftovers and replaces it.
    save_checkpoint(path, GPT(CFG), extra={"step": 2}, asynchronous=True).wait()
    assert not incomplete_dir(path).exists() and not old_dir(path).exists()
    assert load_checkpoint(path, GPT(CFG)) == {"step": 2}
