"""``fsdp-demo`` end to end: it trains on 2 CPU ranks, saves a checkpoint, plots, and
resumes (here at another strategy, so that the checkpoint is resharded); under
``torchrun`` the launcher decides the ranks and each still trains on ``--batch-size``
sequences; bad arguments fail before any rank starts, with a message saying what is
wrong."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from fsdp.demo.cli import main
from fsdp.demo.options import CHECKPOINT_DIR, parse_args
from fsdp.demo.plot import PLOT_FILE
from fsdp.demo.summary import SUMMARY_FIELDS, comm_bound_bytes, summary_lines
from fsdp.demo.train import METRICS_FILE

STEPS = 5
RESUME_STEPS = 3
RUN_TIMEOUT_S = 280


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the installed ``fsdp-demo`` command (its console script next to Python)."""
    script = Path(sys.executable).with_name("fsdp-demo")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "fsdp.demo"]
    done = subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )
    assert done.returncode == 0, f"fsdp-demo {args} failed:\n{done.stdout}\n{done.stderr}"
    return done


def _history(out: Path) -> list[dict]:
    return json.loads((out / METRICS_FILE).read_text())["history"]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("demo")
    done = _demo("--steps", str(STEPS), "--out", str(out))
    return out, done.stdout


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_demo_trains_checkpoints_and_plots(first_run):
    out, stdout = first_run
    checkpoint, plot = out / CHECKPOINT_DIR, out / PLOT_FILE
    assert f"checkpoint: {checkpoint}" in stdout and f"plot:       {plot}" in stdout, stdout
    assert (checkpoint / "fsdp_manifest.json").is_file()
    assert "saving:     blocked training" in stdout and "(asynchronous" in stdout, stdout
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    history = _history(out)
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    losses = [h["loss"] for h in history]
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], f"the loss did not fall: {losses}"
    for h in history:
        assert len(h["memory_mb"]) == 2 and min(h["memory_mb"]) > 0
        assert h["tokens_per_s"] > 0
    comm = [h["comm_mb"] for h in history]
    assert comm == sorted(comm) and comm[0] > 0, comm  # ZeRO-3 communicates every step
    assert all(h["step_ms"] > 0 for h in history)
    assert sum(h["comm_step_mb"] for h in history) == pytest.approx(comm[-1])
    # Root parameters (embeddings, final norm) are gathered once a step, not twice, so a
    # ZeRO-3 step sends less than 3Ψ(N−1)/N; the blocks' gathers and every reduction
    # still send most of it.
    last = history[-1]
    assert last["comm_bound_passes"] == 3
    assert 0.5 * last["comm_bound_mb"] < last["comm_step_mb"] <= last["comm_bound_mb"], last
    for label in ("loss", "step time", "memory", "bytes sent", "metrics"):
        assert f"\n  {label}:" in stdout, (label, stdout)
    assert "x the bound 3Ψ(N−1)/N" in stdout, stdout


@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
def test_demo_resumes_at_another_strategy(first_run):
    out, _ = first_run
    before = _history(out)
    done = _demo("--resume", "--steps", str(RESUME_STEPS), "--strategy", "optim", "--out", str(out))
    assert f"steps {STEPS}..{STEPS + RESUME_STEPS}" in done.stdout, done.stdout
    history = _history(out)
    assert [h["step"] for h in history] == list(range(1, STEPS + RESUME_STEPS + 1))
    assert history[:STEPS] == before
    assert all(math.isfinite(h["loss"]) for h in history)


def test_summary_lines_label_each_field_and_skip_what_a_run_lacks():
    """One line per field, labels aligned; a history from an older checkpoint (no step
    time, no per-step bytes) and a run that saved nothing leave those lines out instead
    of failing."""
    old = {"step": 1, "loss": 4.0, "tokens_per_s": 1e3, "memory_mb": [10.0, 12.0]}
    new = {
        **old,
        "step": 2,
        "loss": 3.5,
        "step_ms": 20.0,
        "memory_mb": [11.0, 13.0],
        "comm_step_mb": 1.5,
        "comm_bound_mb": 2.0,
        "comm_bound_passes": 3,
    }
    summary = {"history": [old, new], "memory_kind": "RSS", "checkpoint_blocked_s": 0.0125}
    lines = summary_lines(summary, [("plot", "x.png")])
    assert len(lines) == len(SUMMARY_FIELDS) + 1
    assert lines[0] == "  loss:       4.000 at step 1 -> 3.500 at step 2"
    assert lines[-1] == "  plot:       x.png"
    assert "1.50 MB per rank a step = 0.750 x the bound 3Ψ(N−1)/N = 2.00 MB" in lines[3]
    assert "11/13 MB per rank" in lines[2] and "at most 13 MB" in lines[2]
    assert (
        lines[4]
        == "  saving:     blocked training 0.013 s (asynchronous; written in the background)"
    )
    summary["history"] = [old]
    del summary["checkpoint_blocked_s"]
    assert [ln.split(":")[0].strip() for ln in summary_lines(summary)] == ["loss", "memory"]


def test_comm_bound_is_three_passes_under_zero3_else_two():
    assert comm_bound_bytes("optim_grads_params", 1000, 4) == 3 * 1000 * 3 / 4
    for strategy in ("optim_grads", "optim", "no_shard"):
        assert comm_bound_bytes(strategy, 1000, 4) == 2 * 1000 * 3 / 4
    assert comm_bound_bytes("optim_grads_params", 1000, 1) == 0


def test_resume_takes_the_checkpoints_seq_len_and_refuses_another(first_run, capsys):
    out, _ = first_run
    assert parse_args(["--resume", "--out", str(out)]).seq_len == 64  # the first run's
    with pytest.raises(SystemExit) as info:
        main(["--resume", "--seq-len", "32", "--out", str(out)])  # before any rank starts
    assert info.value.code == 2
    assert "was trained with --seq-len 64" in capsys.readouterr().err


# torchrun, not --nproc (default 2 on CPU), decides the ranks. 3 ranks with 3 sequences
# each: with the global batch taken as batch_size * --nproc (6), each rank would get 2.
TORCHRUN_RANKS = 3
TORCHRUN_BATCH = 3
TORCHRUN_SEQ_LEN = 16


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_demo_under_torchrun_trains_batch_size_per_rank(tmp_path):
    script = Path(sys.executable).with_name("torchrun")
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]
    launcher += ["--standalone", "--nproc-per-node", str(TORCHRUN_RANKS), "-m", "fsdp.demo"]
    args = ["--batch-size", str(TORCHRUN_BATCH), "--seq-len", str(TORCHRUN_SEQ_LEN)]
    args += ["--steps", "2", "--out", str(tmp_path)]
    done = subprocess.run(
        [*launcher, *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"torchrun fsdp-demo failed:\n{done.stdout}\n{done.stderr}"
    global_batch = TORCHRUN_RANKS * TORCHRUN_BATCH
    assert f"{TORCHRUN_RANKS} rank(s) on cpu" in done.stdout, done.stdout
    assert f"global batch {global_batch}x{TORCHRUN_SEQ_LEN} ({TORCHRUN_BATCH} per rank)" in (
        done.stdout
    ), done.stdout
    assert done.stdout.count("checkpoint:") == 1, "only rank 0 reports"
    summary = json.loads((tmp_path / METRICS_FILE).read_text())
    assert summary["world_size"] == TORCHRUN_RANKS
    assert (summary["batch_size"], summary["global_batch"]) == (TORCHRUN_BATCH, global_batch)
    assert [h["step"] for h in summary["history"]] == [1, 2]
    for h in summary["history"]:
        assert h["sequences_per_rank"] == [TORCHRUN_BATCH] * TORCHRUN_RANKS, h
        assert len(h["memory_mb"]) == TORCHRUN_RANKS and math.isfinite(h["loss"])
    assert (tmp_path / CHECKPOINT_DIR / "fsdp_manifest.json").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "0"], "--nproc must be at least 1"),
        (["--strategy", "zero4"], "Invalid sharding strategy 'zero4'"),
        (["--steps", "0"], "--steps must be positive"),
        (["--resume", "--out", "/nonexistent/fsdp-demo"], "no checkpoint at"),
        (["--nproc", "two"], "invalid int value"),
        (["--device", "tpu"], "invalid choice"),
    ],
)
def test_bad_arguments_fail_clearly(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message when CUDA is absent")
def test_cuda_requested_but_absent(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--device", "cuda"])
    assert info.value.code == 2
    assert "no CUDA device is available" in capsys.readouterr().err


def _fake_torchrun_node(monkeypatch: pytest.MonkeyPatch, local_ranks: int, gpus: int) -> None:
    """This process as one of ``local_ranks`` ranks torchrun started on a node with
    ``gpus`` GPUs (checked by the argument parser only: nothing touches a GPU)."""
    for name, value in {
        "TORCHELASTIC_RUN_ID": "test",
        "RANK": "0",
        "WORLD_SIZE": str(2 * local_ranks),
        "LOCAL_WORLD_SIZE": str(local_ranks),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)


def test_torchrun_decides_the_ranks_not_nproc(monkeypatch, capsys):
    """Under torchrun --nproc is ignored (a stale --nproc 16 on an 8-GPU node is no
    error), but more ranks on a node than it has GPUs is."""
    _fake_torchrun_node(monkeypatch, local_ranks=8, gpus=8)
    assert parse_args(["--device", "cuda", "--nproc", "16"]).batch_size == 8
    _fake_torchrun_node(monkeypatch, local_ranks=8, gpus=4)
    with pytest.raises(SystemExit) as info:
        parse_args(["--device", "cuda"])
    assert info.value.code == 2
    assert "torchrun started 8 ranks on this node, which has 4 GPUs" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("uv") is None, reason="builds the wheel with uv")
def test_wheel_ships_the_corpus_and_the_command(tmp_path):
    root = Path(__file__).resolve().parents[1]
    subprocess.run(
        ["uv", "build", "--wheel", "--out-dir", str(tmp_path), str(root)],
        check=True,
        capture_output=True,
        timeout=RUN_TIMEOUT_S,
    )
    (wheel,) = tmp_path.glob("fsdp-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt")))
    assert "fsdp/demo/data/fables.txt" in names
    assert b"fsdp-demo = fsdp.demo.cli:main" in entry_points
