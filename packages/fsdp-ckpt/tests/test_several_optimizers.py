"""The documented two-optimizer form (``model, (muon, adamw) = fully_shard(module,
[Muon(hidden), AdamW(rest)])``) checkpoints in one directory: ``save_checkpoint(path,
model, [muon, adamw])`` writes the model once and both optimizers' states under
``optim`` (the layout of torch's ``get_optimizer_state_dict(model, [opt1, opt2])``:
their states by parameter name, their param groups one after the other), and
``load_checkpoint`` with the same list resumes training exactly, also at another world
size. Anything else passed as the optimizer is a ``TypeError`` saying what to pass,
raised before anything is created on disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from fsdp_ckpt import CheckpointMismatchError, load_checkpoint, save_checkpoint
from fsdp_hooks import fully_shard
from fsdp_mesh.testing import run_distributed

pytestmark = pytest.mark.skipif(
    not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9"
)

STEPS, HALF, BATCH = 6, 3, 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h)


def _split(module: nn.Module) -> list[torch.optim.Optimizer]:
    hidden = [p for n, p in module.named_parameters() if n.startswith("layers.") and p.ndim == 2]
    rest = [
        p for n, p in module.named_parameters() if not (n.startswith("layers.") and p.ndim == 2)
    ]
    return [torch.optim.Muon(hidden, lr=5e-3), torch.optim.AdamW(rest, lr=5e-3, eps=1e-3)]


def _wrapped(seed: int, strategy: int = 3):
    torch.manual_seed(seed)
    module = Net()
    return fully_shard(
        module, _split(module), fsdp_unit_modules=[nn.Linear], zero_dp_strategy=strategy
    )


def _steps(model, opts, start: int, stop: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    b = BATCH // world
    losses = []
    for step in range(start, stop):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)
        loss = F.mse_loss(model(x[rank * b : (rank + 1) * b]), y[rank * b : (rank + 1) * b])
        loss.backward()
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _save(path: str) -> list[float]:
    model, (muon, adamw) = _wrapped(0)
    losses = _steps(model, [muon, adamw], 0, HALF)
    save_checkpoint(path, model, [muon, adamw], extra={"step": HALF})
    return losses + _steps(model, [muon, adamw], HALF, STEPS)  # uninterrupted


def _resume(path: str, strategy: int) -> list[float]:
    model, (muon, adamw) = _wrapped(1234, strategy)  # every value from the checkpoint
    assert load_checkpoint(path, model, (muon, adamw)) == {"step": HALF}
    assert all(s["step"].item() == HALF for s in adamw.state.values())
    assert all(s["momentum_buffer"].abs().sum() > 0 for s in muon.state.values())
    return _steps(model, [muon, adamw], HALF, STEPS)


def test_two_optimizers_save_and_load_in_one_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(_save, 2, args=(path,), timeout=120)[0]
    # the model written once: one entry per model key (not a checkpoint per optimizer)
    from torch.distributed.checkpoint import FileSystemReader

    keys = list(FileSystemReader(path).read_metadata().state_dict_metadata)
    assert sum(k == "model.head.weight" for k in keys) == 1
    assert any(k.startswith("optim.state.layers.0.weight.momentum_buffer") for k in keys)
    assert any(k.startswith("optim.state.head.weight.exp_avg") for k in keys)
    resumed = run_distributed(_resume, 2, args=(path, 3), timeout=120)[0]
    torch.testing.assert_close(resumed, uninterrupted[HALF:], rtol=0, atol=1e-6)
    # another world size and strategy: Muon's Newton-Schulz rounds in bf16, so the
    # reduction order changes last bits (see fsdp_hooks' test_whole_matrix)
    other = run_distributed(_resume, 4, args=(path, 1), timeout=120)[0]
    torch.testing.assert_close(other, uninterrupted[HALF:], rtol=0, atol=1e-5)


def _misuse(root: str) -> dict[str, str]:
    model, (muon, adamw) = _wrapped(0)
    got = {}
    for name, optimizer in {
        "dict": {"muon": muon, "adamw": adamw},
        "nested": [[muon], adamw],
        "module": [muon, model],
        "empty": [],
        "twice": [adamw, adamw],
    }.items():
        try:
            save_checkpoint(Path(root) / name, model, optimizer)
            got[name] = "saved"
        except TypeError as exc:
            got[name] = f"TypeError: {exc}"
        except ValueError as exc:
            got[name] = f"ValueError: {exc}"
    save_checkpoint(Path(root) / "ok", model, [muon, adamw])
    try:  # one optimizer of the two: the groups do not match, named before any load
        load_checkpoint(Path(root) / "ok", model, adamw)
        got["one_of_two"] = "loaded"
    except CheckpointMismatchError as exc:
        got["one_of_two"] = str(exc)
    return got


def test_anything_else_is_a_type_error_before_anything_is_written(tmp_path):
    got = run_distributed(_misuse, 2, args=(str(tmp_path),), timeout=120)
    assert got[0] == got[1], got
    got = got[0]
    for name in ("dict", "nested", "module"):
        assert got[name].startswith("TypeError: "), (name, got[name])
        assert "a torch.optim.Optimizer or a list of them" in got[name], got[name]
    assert got["empty"].startswith("ValueError: ") or got["empty"].startswith("TypeError: ")
    assert got["twice"].startswith("ValueError: ") and "more than once" in got["twice"], got
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]  # nothing else created
    assert "param group" in got["one_of_two"], got["one_of_two"]
