"""Ranks that diverge at run time (issue 19 item 6).

A unit skipped on one rank under ZeRO-3 made the ranks' gathers pair with different
buckets: a hang, or wrong weights when the buckets had one size. With
``FSDP_CHECK_SCHEDULE=1`` every rank raises at the first point where they differ,
naming the unit, the rank and the step; with ``FSDP_COLLECTIVE_TIMEOUT_S`` a gather
that nobody answers raises after that many seconds, naming its bucket and unit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from fsdp_buffers.collectives import CollectiveError
from fsdp_hooks import fully_shard
from fsdp_hooks.runtime.schedule_check import ScheduleDivergedError
from fsdp_mesh.testing import run_distributed

WORLD = 2
DIM = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor, skip: int | None = None) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i != skip:
                x = block(x)
        return x


def _wrapped():
    torch.manual_seed(0)
    module = Model()
    return fully_shard(
        module,
        torch.optim.AdamW(module.parameters()),
        fsdp_unit_modules=[Block],
        zero_dp_strategy=3,
        suggested_communication_unit_size=0,  # messages name one unit's bucket
    )


def _skip_a_unit() -> str:
    model, optimizer = _wrapped()
    rank = dist.get_rank()
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank))
    for step in range(3):
        skip = 1 if (step == 1 and rank == 1) else None
        try:
            loss = F.mse_loss(model(x, skip=skip), torch.zeros_like(x))
            loss.backward()
        except ScheduleDivergedError as err:
            return f"step {step}: {err}"
        optimizer.step()
        optimizer.zero_grad()
    return "no error"


def test_skipped_unit_raises_on_every_rank_naming_it():
    messages = run_distributed(_skip_a_unit, WORLD, timeout=60, env={"FSDP_CHECK_SCHEDULE": "1"})
    for message in messages:
        assert message.startswith("step 1: ranks diverged"), message
        assert "rank 1 is at step 1, unit forward of unit 'blocks.2'" in message, message
        assert "rank 0 is at step 1, unit forward of unit 'blocks.1'" in message, message


def _one_rank_stops() -> str:
    model, _optimizer = _wrapped()
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 1:
        store.wait(["rank0_done"])  # this rank never joins the gather
        return "waited"
    try:
        model(torch.randn(4, DIM))
    except CollectiveError as err:
        return str(err)
    finally:
        store.set("rank0_done", "1")
    return "no error"


def test_unanswered_gather_times_out_naming_its_bucket():
    messages = run_distributed(
        _one_rank_stops, WORLD, timeout=60, env={"FSDP_COLLECTIVE_TIMEOUT_S": "2"}
    )
    assert messages[1] == "waited"
    assert messages[0].startswith(
        "the all-gather of bucket 0 (unit 'blocks.0': blocks.0.fc.weight, blocks.0.fc.bias) "
        "did not complete within FSDP_COLLECTIVE_TIMEOUT_S=2s"
    ), messages[0]
