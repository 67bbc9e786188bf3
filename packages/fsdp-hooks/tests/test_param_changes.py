"""What users do to parameters between steps (issue 19 items 7, 8 and 12).

- In-place writes after wrapping (``p.mul_(0.5)``, an EMA copied back through ``p.data``)
  used not to reach the compute weights: under ZeRO-1/2 each rank saw only its own rows.
- ``requires_grad`` changed after wrapping was ignored: a block frozen later kept
  training. Freezing is honoured; unfreezing a parameter frozen at wrap raises.
- A parameter no backward reached got a zero gradient instead of None, so AdamW's weight
  decay still moved it.

Under every strategy the losses, the final weights, and which parameters have a gradient
must match one process doing the same on the whole batch.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from fsdp_hooks import fully_shard
from fsdp_mesh.testing import assert_same_training, mean_over_ranks, run_distributed

WORLD = 2
STEPS = 4
ROWS = 4
DIM = 8
LR = 1e-2
FREEZE_AFTER = 1  # blocks.0 is frozen after this step
STRATEGIES = (0, 1, 2, 3)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.unused = nn.Linear(DIM, DIM)  # never called
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build() -> Model:
    torch.manual_seed(0)
    return Model()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(ROWS, DIM, generator=g), torch.randn(ROWS, 2, generator=g)


def between_steps(module: nn.Module, step: int) -> None:
    """The same on the wrapped module (DTensor parameters) and on the reference."""
    with torch.no_grad():
        if step == 0:
            for p in module.parameters():
                p.mul_(0.5)
            module.head.weight.data.add_(0.25)  # an EMA copied back through .data
    if step == FREEZE_AFTER:
        module.blocks[0].requires_grad_(False)


def _with_grad(module: nn.Module) -> list[str]:
    return sorted(n for n, p in module.named_parameters() if p.grad is not None)


def _train() -> dict:
    rank = dist.get_rank()
    out = {}
    for strategy in STRATEGIES:
        module = build()
        optimizer = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.1)
        model, optimizer = fully_shard(
            module, optimizer, fsdp_unit_modules=[Block], zero_dp_strategy=strategy
        )
        losses, with_grad = [], []
        for step in range(STEPS):
            x, y = batch(step, rank)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            with_grad.append(_with_grad(model.module))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(mean_over_ranks(loss))
            between_steps(model.module, step)
        out[strategy] = {
            "losses": losses,
            "with_grad": with_grad,
            "params": model.buffer.views.full_parameters(),
            "unfreeze": _unfreeze_error(strategy),
        }
    return out if rank == 0 else {}


def _unfreeze_error(strategy: int) -> str:
    module = build()
    module.blocks[1].requires_grad_(False)
    trainable = [p for p in module.parameters() if p.requires_grad]
    model, _opt = fully_shard(
        module, torch.optim.AdamW(trainable), fsdp_unit_modules=[Block], zero_dp_strategy=strategy
    )
    model.module.blocks[1].requires_grad_(True)
    try:
        model(torch.randn(ROWS, DIM))
    except ValueError as err:
        return str(err)
    return "no error"


@functools.cache
def reference() -> dict:
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, with_grad = [], []
    for step in range(STEPS):
        loss = sum(F.mse_loss(model(x), y) for x, y in (batch(step, r) for r in range(WORLD)))
        loss = loss / WORLD
        loss.backward()
        with_grad.append(_with_grad(model))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        between_steps(model, step)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "with_grad": with_grad, "params": params}


@pytest.fixture(scope="module")
def trained() -> dict:
    return run_distributed(_train, WORLD, timeout=150)[0]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: f"zero{s}")
def test_writes_freezing_and_unused_match_pytorch(trained, strategy):
    ref, got = reference(), trained[strategy]
    assert got["with_grad"] == ref["with_grad"]
    assert all("unused.weight" not in names for names in got["with_grad"])
    assert_same_training(got, ref, where=f"zero{strategy}")


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: f"zero{s}")
def test_unfreezing_a_parameter_frozen_at_wrap_raises(trained, strategy):
    message = trained[strategy]["unfreeze"]
    assert "'blocks.1.fc.weight'" in message and "frozen" in message, message
