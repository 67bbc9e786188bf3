"""Parameters that get no gradient on some ranks.

A branch runs only when a condition on the rank's own data holds: inside each FSDP unit
(``BranchBlock.extra``) and outside every unit (``BranchModel.side``). Each step decides
per rank, so on a step where rank 0 takes the branch and rank 1 does not, the branch's
parameters get a gradient on rank 0 only, and their buckets are incomplete on rank 1
until the end of backward. Backward must still end on every rank (no hang: the
collectives stay matched), and the reduced gradient must be the mean of the ranks'
gradients, a missing one counting as zero; that is what one process computes from the
mean of the ranks' losses, each rank's loss computed on its own slice with its own
decision. Under every strategy, world size 2, the losses, gradients and final
parameters of AdamW steps match that reference within 1e-5 relative. Under ZeRO-3 the
blocks' gathers in backward and the reductions share the shard group, so a rank that
started a block's reduction on its own schedule would deadlock the other (hooks.py,
"When reductions start"); and the reductions must still overlap backward rather than
all wait for its end, which is checked when the gradient reaches the first block
(with ``overlap_grad_reduce=False`` they must all wait, with the same results).

Every step has at least one rank taking the branch: a parameter that no rank used
(gradient None, as in the reference) is ``test_param_changes``'s subject.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from fsdp_hooks import TrainingState, fully_shard
from fsdp_mesh.testing import (
    assert_losses_close,
    assert_tensors_close,
    gather_rows,
    run_distributed,
)

WORLD = 2
STRATEGIES = (0, 1, 2, 3)
# (strategy, overlap_grad_reduce): without overlap every reduction waits for the end
# of backward, with the same results.
CONFIGS = (*((s, True) for s in STRATEGIES), (0, False), (3, False))
# Which ranks take the branch at each step.
TAKES_BRANCH = ((True, False), (False, True), (True, True), (True, False))
STEPS = len(TAKES_BRANCH)
ROWS = 4  # per rank
DIM = 16
IN, OUT = 6, 3
LR = 1e-2
N_BLOCKS = 3


class BranchBlock(nn.Module):
    """The FSDP unit: residual MLP plus a branch taken only when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)
        self.extra = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, take_branch: bool) -> torch.Tensor:
        h = x + self.fc2(F.gelu(self.fc1(self.ln(x))))
        return h + torch.tanh(self.extra(h)) if take_branch else h


class BranchModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList(BranchBlock() for _ in range(N_BLOCKS))
        self.side = nn.Linear(DIM, DIM)  # outside every unit
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        take_branch = bool(x[:, 0].sum() > 0)  # decided by this rank's data
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, take_branch=take_branch)
        if take_branch:
            h = h + torch.tanh(self.side(h))
        return self.head(h)


def build() -> BranchModel:
    torch.manual_seed(0)
    return BranchModel()


def rank_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s slice at ``step``; its first column's sign picks the branch."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(ROWS, IN, generator=g), torch.randn(ROWS, OUT, generator=g)
    sign = 1.0 if TAKES_BRANCH[step][rank] else -1.0
    x[:, 0] = sign * x[:, 0].abs()
    return x, y


def _full(model, name: str, local: torch.Tensor, placement) -> torch.Tensor:
    """A whole tensor from the ranks' dim-0 row shards."""
    if placement.is_replicate():
        return local.clone()
    return gather_rows(local, model.buffer.views.local_rows(name))


def _named_full(model, get) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        name = name.removeprefix("module.")
        t = get(p)
        out[name] = _full(model, name, t.to_local(), t.placements[0])
    return out


def _record_reductions_at_first_block(model, record: list[int]) -> None:
    """Append to ``record`` the reductions issued so far whenever a gradient reaches the
    first block's output. By then the later blocks' buckets are reduced (overlapping
    the rest of backward), on every rank alike, whether or not it took the branch."""

    def on_grad(_grad: torch.Tensor) -> None:
        stats = model.comm_stats()
        record.append(stats["reduce_scatter"]["calls"] + stats["all_reduce"]["calls"])

    def on_output(_module: nn.Module, _args: tuple, output: torch.Tensor) -> None:
        output.register_hook(on_grad)

    model.module.blocks[0].register_forward_hook(on_output)


def _train() -> dict:
    rank = dist.get_rank()
    out: dict = {}
    for strategy, overlap in CONFIGS:
        module = build()
        optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
        model, optimizer = fully_shard(
            module,
            optimizer,
            fsdp_unit_modules=[BranchBlock],
            zero_dp_strategy=strategy,
            overlap_grad_reduce=overlap,
            suggested_communication_unit_size=0,  # reductions counted per unit
        )
        reduced_early: list[int] = []
        _record_reductions_at_first_block(model, reduced_early)
        losses, grads = [], []
        for step in range(STEPS):
            x, y = rank_batch(step, rank)
            loss = F.mse_loss(model(x), y)
            model.comm_stats(reset=True)
            loss.backward()
            assert reduced_early[-1] == (N_BLOCKS - 1 if overlap else 0), (step, reduced_early)
            assert model.training_state is TrainingState.IDLE
            assert all(u.state is TrainingState.IDLE for u in model.hooks.units)
            assert model.all_gather_pipeline.gathered_buckets() == []
            grads.append(_named_full(model, lambda p: p.grad))
            optimizer.step()
            optimizer.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / WORLD)
        params = _named_full(model, lambda p: p)
        out[(strategy, overlap)] = {"losses": losses, "grads": grads, "params": params}
    return out if rank == 0 else {}


@functools.cache
def reference() -> dict:
    """One process: the mean of the ranks' losses, each on its own slice and with its
    own branch decision, so a branch parameter's gradient is the mean of the ranks'
    gradients with zero for a rank that skipped the branch."""
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        per_rank = [F.mse_loss(model(x), y) for x, y in (rank_batch(step, r) for r in range(WORLD))]
        loss = sum(per_rank) / WORLD
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


@pytest.fixture(scope="module")
def trained() -> dict:
    return run_distributed(_train, WORLD, timeout=120)[0]


def test_branch_decisions_differ_across_ranks():
    # The data really makes the ranks disagree on some steps (what this file tests).
    for step, takes in enumerate(TAKES_BRANCH):
        for rank in range(WORLD):
            x = rank_batch(step, rank)[0]
            assert bool(x[:, 0].sum() > 0) is takes[rank]
    assert any(len(set(t)) > 1 for t in TAKES_BRANCH) and all(any(t) for t in TAKES_BRANCH)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"zero{c[0]}-overlap{int(c[1])}")
def test_unused_branch_matches_reference(trained, config):
    ref = reference()
    record = trained[config]
    assert_losses_close(record["losses"], ref["losses"])
    for step in range(STEPS):
        assert_tensors_close(
            record["grads"][step], ref["grads"][step], atol=1e-7, where=f"step {step} grad"
        )
    assert_tensors_close(record["params"], ref["params"])
