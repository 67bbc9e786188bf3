"""Gradient paths into a unit's weights that bypass the unit's outputs (issue 19 item 3).

A MoE-style auxiliary loss kept on the module (``self.aux = f(self.fc.weight)``) and
added to the loss after the forward reaches a unit's weights without going through its
outputs, so under ZeRO-3 that unit's pre-backward (which gathers its buckets) need not
have run when the auxiliary branch's backward reads the weights: it read freed memory (a
segfault) or, with ``fsdp_double_buffer``, another unit's weights (silently wrong). And a
unit returning a plain ``@dataclass`` hid its output tensors from the hooks. Under every
strategy, with and without double buffering, the losses and final weights of AdamW steps
must equal one process on the whole batch.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from fsdp_hooks import fully_shard
from fsdp_mesh.testing import assert_tensors_close, mean_over_ranks, run_distributed

WORLD = 2
STEPS = 3
ROWS = 4
DIM = 8
LR = 1e-2
AUX = 1e-2
CONFIGS = ((0, False), (1, False), (2, False), (3, False), (3, True))
# How the auxiliary loss reaches backward: added to the loss, or through a backward of
# its own before the main one (its graph reaches no unit's output at all: only with
# FSDP_REGATHER_SAVED_WEIGHTS=1, see test_separate_side_backward_raises_by_default).
MODES = ("summed", "separate")


@dataclasses.dataclass
class BlockOut:
    hidden: torch.Tensor
    gate: torch.Tensor


class AuxBlock(nn.Module):
    """Keeps an auxiliary loss on the weights only; returns its output in a dataclass."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.gate = nn.Linear(DIM, 1)
        self.aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> BlockOut:
        self.aux = self.fc.weight.pow(2).sum() + self.gate.weight.abs().sum()
        return BlockOut(x + torch.tanh(self.fc(x)), torch.sigmoid(self.gate(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(AuxBlock() for _ in range(4))
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            out = block(h)
            h = out.hidden * out.gate
        return self.head(h)

    def aux_loss(self) -> torch.Tensor:
        return sum(block.aux for block in self.blocks)


def build() -> Model:
    torch.manual_seed(0)
    return Model()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(ROWS, DIM, generator=g), torch.randn(ROWS, 2, generator=g)


def _train(mode: str) -> dict:
    rank = dist.get_rank()
    out = {}
    for strategy, double_buffer in CONFIGS:
        module = build()
        optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
        model, optimizer = fully_shard(
            module,
            optimizer,
            fsdp_unit_modules=[AuxBlock],
            zero_dp_strategy=strategy,
            fsdp_double_buffer=double_buffer,
        )
        losses = []
        for step in range(STEPS):
            x, y = batch(step, rank)
            loss = _loss(model(x), y, model.module.aux_loss(), mode)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(mean_over_ranks(loss))
        out[(strategy, double_buffer)] = {
            "losses": losses,
            "params": model.buffer.views.full_parameters(),
        }
    return out if rank == 0 else {}


def _loss(pred: torch.Tensor, y: torch.Tensor, aux: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "summed":
        return F.mse_loss(pred, y) + AUX * aux
    (AUX * aux).backward()
    return F.mse_loss(pred, y) + AUX * aux.detach()


@functools.cache
def reference() -> dict:
    """The same in either mode: the auxiliary loss is the same on every rank."""
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        per_rank = []
        for r in range(WORLD):
            x, y = batch(step, r)
            per_rank.append(F.mse_loss(model(x), y) + AUX * model.aux_loss())
        loss = sum(per_rank) / WORLD
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


@pytest.fixture(scope="module", params=MODES)
def trained(request) -> tuple[str, dict]:
    env = {"FSDP_REGATHER_SAVED_WEIGHTS": "1"} if request.param == "separate" else {}
    runs = run_distributed(_train, WORLD, args=(request.param,), timeout=120, env=env)
    return request.param, runs[0]


def _separate_by_default() -> str:
    module = build()
    model, _opt = fully_shard(
        module,
        torch.optim.AdamW(module.parameters()),
        fsdp_unit_modules=[AuxBlock],
        zero_dp_strategy=3,
        fsdp_double_buffer=True,  # the read lands in a live slot: no crash before the check
    )
    x, y = batch(0, dist.get_rank())
    try:
        _loss(model(x), y, model.module.aux_loss(), "separate")
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_separate_side_backward_raises_by_default():
    """Without FSDP_REGATHER_SAVED_WEIGHTS a backward that reads a released unit's weights
    (under double buffering: another unit's, silently, before) raises on every rank."""
    for message in run_distributed(_separate_by_default, WORLD, timeout=60):
        assert "without going through the unit's outputs" in message, message
        assert "FSDP_REGATHER_SAVED_WEIGHTS=1" in message, message


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"zero{c[0]}-double{int(c[1])}")
def test_aux_loss_on_weights_and_dataclass_outputs(trained, config):
    mode, runs = trained
    ref = reference()
    got = runs[config]
    torch.testing.assert_close(
        torch.tensor(got["losses"], dtype=torch.float64),
        torch.tensor(ref["losses"], dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )
    assert_tensors_close(got["params"], ref["params"], where=f"{mode} zero{config[0]}")
