"""An FSDP unit called more than once in one forward (shared weights).

Two layouts, each with the unit called twice per forward:

- ``twice``: ``h = block(block(h))``, the two calls back to back;
- ``list``: a ``ModuleList`` holding the same unit at positions 0 and 2, another unit
  between them (``named_modules`` lists it once, so it is one FSDP unit).

Each also under activation recompute (``torch.utils.checkpoint`` around every unit
call, reentrant and not), and, without recompute, with gradients staged in
``main_grad`` (``grad_staging="main_grad"``: the shared unit's second pass stages
gradients while its first pass's reduction may still be in flight). Under every strategy, world size 2, AdamW steps on rank r's
slice of a global batch must reproduce a single process trained on the whole batch:
losses and final parameters within 1e-5 relative. A shared unit's weights get the sum
of both calls' gradients, so a reduction that misses one call's gradient (or a unit
released while the other call's backward still needs it) shows up here as a wrong
gradient, a wrong loss, or a crash.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from fsdp_hooks import TrainingState, fully_shard
from fsdp_mesh.testing import assert_same_training, gather_rows, run_distributed

WORLD = 2
STRATEGIES = (0, 1, 2, 3)
LAYOUTS = ("twice", "list")
RECOMPUTE = ("none", "reentrant", "non_reentrant")
CONFIGS = tuple((lay, rec, "autograd") for lay in LAYOUTS for rec in RECOMPUTE) + tuple(
    (lay, "none", "main_grad") for lay in LAYOUTS
)
STEPS = 4
GLOBAL_BATCH = 8
DIM = 16
IN, OUT = 6, 3
LR = 1e-2


class MLPBlock(nn.Module):
    """The FSDP unit: pre-norm residual MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class ReuseModel(nn.Module):
    def __init__(self, layout: str, recompute: str) -> None:
        super().__init__()
        self.layout = layout
        self.recompute = recompute
        self.inp = nn.Linear(IN, DIM)
        shared, other = MLPBlock(), MLPBlock()
        if layout == "twice":
            self.shared, self.other = shared, other
        else:
            self.layers = nn.ModuleList([shared, other, shared])
        self.head = nn.Linear(DIM, OUT)

    def _call(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        if self.recompute == "none":
            return block(h)
        return checkpoint(block, h, use_reentrant=self.recompute == "reentrant")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.layout == "twice":
            h = self._call(self.shared, self._call(self.shared, h))
            h = self._call(self.other, h)
        else:
            for block in self.layers:
                h = self._call(block, h)
        return self.head(h)


def build(layout: str, recompute: str) -> ReuseModel:
    torch.manual_seed(0)
    return ReuseModel(layout, recompute)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)


def _full(model, name: str, local: torch.Tensor, placement) -> torch.Tensor:
    """A whole tensor from the ranks' dim-0 row shards."""
    if placement.is_replicate():
        return local.clone()
    return gather_rows(local, model.buffer.views.local_rows(name))


def _train(configs: tuple[tuple[str, str], ...]) -> dict:
    rank = dist.get_rank()
    rows = GLOBAL_BATCH // WORLD
    mine = slice(rank * rows, (rank + 1) * rows)
    out: dict = {}
    for strategy in STRATEGIES:
        for layout, recompute, staging in configs:
            module = build(layout, recompute)
            optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
            model, optimizer = fully_shard(
                module,
                optimizer,
                fsdp_unit_modules=[MLPBlock],
                zero_dp_strategy=strategy,
                grad_staging=staging,
            )
            # One unit per distinct block: the shared one is listed once.
            assert len(model.hooks.units) == 2, [u.name for u in model.hooks.units]
            trainable = sum(1 for g in model.buffer.groups if g.requires_grad)
            losses = []
            for step in range(STEPS):
                x, y = batch(step)
                loss = F.mse_loss(model(x[mine]), y[mine])
                model.comm_stats(reset=True)
                loss.backward()
                # Every bucket reduced in each backward (fully_shard syncs each one),
                # and at most once per pass of its unit group (Note [unit groups]): the
                # shared unit's second call may start a second pass of its group (the
                # ``list`` layout; FSDP2 reduces at each call's post-backward too).
                stats = model.comm_stats(reset=True)
                reduced = stats["reduce_scatter"]["calls"] + stats["all_reduce"]["calls"]
                assert trainable <= reduced <= trainable + 1, (reduced, trainable)
                assert model.training_state is TrainingState.IDLE
                assert all(u.state is TrainingState.IDLE for u in model.hooks.units)
                assert model.all_gather_pipeline.gathered_buckets() == []
                optimizer.step()
                optimizer.zero_grad()
                total = loss.detach().clone()
                dist.all_reduce(total)
                losses.append(total.item() / WORLD)
            params = {}
            for name, p in model.named_parameters():
                name = name.removeprefix("module.")
                params[name] = _full(model, name, p.to_local(), p.placements[0])
            out[(strategy, layout, recompute, staging)] = {"losses": losses, "params": params}
    return out if rank == 0 else {}


@functools.cache
def reference(layout: str) -> dict:
    """One process, no fsdp, the whole global batch (recompute changes nothing here)."""
    model = build(layout, "none")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


@pytest.fixture(scope="module")
def trained() -> dict:
    return run_distributed(_train, WORLD, args=(CONFIGS,), timeout=120)[0]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("layout", "recompute", "staging"), CONFIGS)
def test_reused_unit_matches_reference(trained, strategy, layout, recompute, staging):
    ref = reference(layout)
    record = trained[(strategy, layout, recompute, staging)]
    assert_same_training(record, ref, where=f"zero{strategy} {layout} {recompute} {staging}")
