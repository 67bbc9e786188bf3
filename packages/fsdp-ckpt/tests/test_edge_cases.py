"""Checkpoint cases found by probing:

- frozen parameters: a wrapped optimizer leaves them out of its groups, a plain
  ``AdamW(model.parameters())`` keeps them; checkpoints cross both ways all the same;
- buffers that ranks hold differently (BatchNorm statistics under data parallelism):
  the checkpoint, and so its consolidation, keeps rank 0's, as full state dicts do;
- ``get_full_model_state_dict`` is a snapshot: replicated parameters and buffers are
  copies, not views of the live model;
- an optimizer whose groups hold other parameters than the saved one's is refused
  before the model is touched;
- a module whose extra state is a dict (DCP saves it by its leaves) loads back, and
  consolidates to a file that ``load_state_dict`` takes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_buffers import fsdp_no_shard
from fsdp_ckpt import (
    CheckpointMismatchError,
    consolidate_checkpoint,
    get_full_model_state_dict,
    load_checkpoint,
    load_full_state_dict,
    save_checkpoint,
)
from fsdp_hooks import fully_shard
from fsdp_mesh.testing import run_distributed


class Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = Unit()
        self.frozen.requires_grad_(False)
        self.trained = Unit()
        self.replicated = fsdp_no_shard(nn.Linear(6, 6))
        self.register_buffer("stats", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.replicated(self.trained(self.frozen(x)))


def _plain(seed: int) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)  # frozen ones included


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.manual_seed(7)
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _wrapped(seed: int):
    return fully_shard(*_plain(seed), fsdp_unit_modules=[Unit], zero_dp_strategy=3)


def _save_wrapped(path: str) -> None:
    model, opt = _wrapped(0)
    _train(model, opt)
    model.module.stats.fill_(dist.get_rank() + 1)  # rank-dependent, like BN statistics
    save_checkpoint(path, model, opt)


def _load_wrapped(path: str) -> dict[str, torch.Tensor]:
    model, opt = _wrapped(5)
    load_checkpoint(path, model, opt)
    full = get_full_model_state_dict(model)
    before = {k: v.clone() for k, v in full.items()}
    _train(model, opt)  # the snapshot must not follow the live model
    for key, value in full.items():
        assert torch.equal(value, before[key]), key
    return full


def test_frozen_parameters_rank_buffers_and_snapshots(tmp_path: Path):
    wrapped, plain = tmp_path / "wrapped", tmp_path / "plain"
    run_distributed(_save_wrapped, 4, args=(str(wrapped),), timeout=120)

    # ZeRO-3 at 4 ranks -> one process with the plain optimizer over every parameter.
    model, opt = _plain(1)
    load_checkpoint(wrapped, model, opt)
    assert torch.equal(model.stats, torch.ones(3))  # rank 0's
    consolidate_checkpoint(wrapped, tmp_path / "full.pt")
    full = load_full_state_dict(tmp_path / "full.pt")
    assert torch.equal(full["stats"], torch.ones(3))
    for key, value in model.state_dict().items():
        assert torch.equal(value, full[key]), key

    # ... and back: a plain checkpoint (frozen parameters in its groups) into ZeRO-3.
    _train(model, opt)
    save_checkpoint(plain, model, opt)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    got = run_distributed(_load_wrapped, 2, args=(str(plain),), timeout=120)[0]  # rank 0's
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_other_param_groups_are_refused_before_loading(tmp_path: Path):
    def two_groups(model: Net, swap: bool) -> torch.optim.Optimizer:
        groups = [list(model.trained.parameters()), list(model.replicated.parameters())]
        return torch.optim.AdamW([{"params": g} for g in (groups[::-1] if swap else groups)])

    torch.manual_seed(0)
    model = Net()
    opt = two_groups(model, swap=False)
    _train(model, opt)
    save_checkpoint(tmp_path / "ckpt", model, opt)
    torch.manual_seed(1)
    target = Net()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match="param group 0 holds different"):
        load_checkpoint(tmp_path / "ckpt", target, two_groups(target, swap=True))
    for key, value in target.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} was loaded despite the error"


class WithExtraState(nn.Module):
    def __init__(self, calls: int) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.meta = {"calls": calls, "tag": "x"}

    def get_extra_state(self) -> dict:
        return dict(self.meta)

    def set_extra_state(self, state: dict) -> None:
        self.meta = dict(state)


def test_dict_extra_state_round_trips_and_consolidates(tmp_path: Path):
    saved = WithExtraState(7)
    save_checkpoint(tmp_path / "ckpt", saved)
    target = WithExtraState(0)
    load_checkpoint(tmp_path / "ckpt", target)
    assert target.meta == {"calls": 7, "tag": "x"}
    assert torch.equal(target.lin.weight, saved.lin.weight)
    consolidate_checkpoint(tmp_path / "ckpt", tmp_path / "full.pt")
    fresh = WithExtraState(0)
    fresh.load_state_dict(load_full_state_dict(tmp_path / "full.pt"))
    assert fresh.meta == {"calls": 7, "tag": "x"}
