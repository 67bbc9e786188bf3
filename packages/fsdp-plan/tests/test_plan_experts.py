"""``fsdp.plan`` with an expert mesh (world 4: dense shard group of 4, expert mesh of
2 expert data-parallel x 2 expert-parallel ranks): each rank holds 2 of 4 experts, in
their own buckets sharded over 2 ranks; the plan of rank 0's module equals
``memory_stats()`` and ``comm_stats()`` of every rank within 1%."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_hooks import fully_shard
from fsdp_mesh import build_device_mesh
from fsdp_mesh.testing import run_distributed
from fsdp_plan import MODEL_STATE_KEYS, plan

WORLD, EP, LOCAL_EXPERTS = 4, 2, 2


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(12, 30)
        self.w2 = nn.Linear(30, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.tanh(self.w1(x)))


class MoEBlock(nn.Module):
    """This rank's experts, summed (the token exchange is the model's business, not
    fsdp's, and moves nothing fsdp counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(12, 4, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(LOCAL_EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(self.router(x), -1)[..., :1]
        return x + gate * sum(e(x) for e in self.experts)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 12)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(2))
        self.out = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _step(strategies):
    out = []
    for strategy in strategies:
        torch.manual_seed(0)
        net = Net()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        meshes = build_device_mesh(dp_shard=WORLD, expert_parallel=EP)
        model, opt = fully_shard(
            net,
            opt,
            **meshes.fsdp_kwargs(),
            fsdp_unit_modules=[MoEBlock],
            zero_dp_strategy=strategy,
        )
        for step in range(2):
            model.reset_comm_stats()
            x = torch.randn(5, 7, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        out.append((strategy, model.memory_stats(), model.comm_stats()))
    return out


def _close(planned: float, measured: float) -> bool:
    return abs(planned - measured) <= 0.01 * max(abs(measured), 1)


def test_expert_plan_matches_memory_stats_and_comm_stats():
    strategies = (0, 1, 2, 3)
    measured = run_distributed(_step, WORLD, args=(strategies,), timeout=120)
    for strategy in strategies:
        with torch.device("meta"):
            meta = Net()
        p = plan(meta, WORLD, ep=EP, fsdp_unit_modules=[MoEBlock], zero_dp_strategy=strategy)
        figures = [p.per_rank, *p.ranks.values()]
        for rank, results in enumerate(measured):
            ((got, comm),) = [(m, c) for s, m, c in results if s == strategy]
            where = f"experts, strategy {strategy}, rank {rank}"
            mine = [f for f in figures if _close(f["optimizer_state"], got["optimizer_state"])]
            assert mine, f"{where}: no planned rank has {got}; plan {figures}"
            for key in MODEL_STATE_KEYS:
                assert _close(mine[0][key], got[key]), (where, key, mine[0][key], got[key])
            for kind, counts in comm.items():
                if kind == "broadcast":
                    continue
                for field, value in counts.items():
                    assert _close(p.comm[kind][field], value), (
                        where, kind, field, p.comm[kind][field], value
                    )  # fmt: skip
