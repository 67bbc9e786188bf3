"""``fsdp.plan(..., tp=2)`` at world size 4 (2 shard x 2 tp) against the real thing:
the plan of a meta-device module holding one tp rank's pieces (Megatron-Core style
marks) equals ``memory_stats()`` and ``comm_stats()`` of every rank within 1%, for
that module built Megatron-style and for the same model parallelized with torch's
``parallelize_module`` (DTensor parameters), under every strategy; and its gathered
peak equals the bytes of gathered buckets measured at once (ZeRO-3, with and without
the double buffer)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn import functional as F

from fsdp_buffers import collectives
from fsdp_hooks import fully_shard
from fsdp_mesh import build_device_mesh
from fsdp_mesh.testing import run_distributed
from fsdp_plan import MODEL_STATE_KEYS, plan

WORLD, DP, TP = 4, 2, 2
DIN, DIM, HIDDEN, DOUT = 6, 10, 12, 5
# (model kind, strategy, double buffer)
RUNS = [("megatron", s, False) for s in (0, 2, 3)] + [
    ("megatron", 3, True),
    ("dtensor", 3, False),
    ("dtensor", 1, False),
]


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _mark(p: nn.Parameter, dim: int) -> nn.Parameter:
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
    return p


class ColumnParallel(nn.Module):
    """One tp rank's rows of a ``Linear(d_in, d_out)``."""

    def __init__(self, d_in: int, d_out: int, group=None) -> None:
        super().__init__()
        self.group = group
        self.weight = _mark(nn.Parameter(torch.randn(d_out // TP, d_in) * 0.1), 0)
        self.bias = _mark(nn.Parameter(torch.zeros(d_out // TP)), 0)

    def forward(self, x):
        return F.linear(_CopyToTP.apply(x, self.group), self.weight, self.bias)


class RowParallel(nn.Module):
    """One tp rank's columns of a ``Linear(d_in, d_out)``; the bias replicated."""

    def __init__(self, d_in: int, d_out: int, group=None) -> None:
        super().__init__()
        self.group = group
        self.weight = _mark(nn.Parameter(torch.randn(d_out, d_in // TP) * 0.1), 1)
        self.bias = nn.Parameter(torch.zeros(d_out))
        self.bias.tensor_model_parallel = False

    def forward(self, x):
        return _ReduceFromTP.apply(F.linear(x, self.weight), self.group) + self.bias


class Block(nn.Module):
    def __init__(self, group=None, megatron: bool = True) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        if megatron:
            self.up = ColumnParallel(DIM, HIDDEN, group)
            self.down = RowParallel(HIDDEN, DIM, group)
        else:
            self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, group=None, megatron: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(DIN, DIM)
        self.blocks = nn.ModuleList(Block(group, megatron) for _ in range(3))
        self.head = nn.Linear(DIM, DOUT)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _gathered_meter(buffer):
    from test_plan_gathered_peak import GatheredMeter

    return GatheredMeter(buffer)


def _steps(runs):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    meshes = build_device_mesh(dp_shard=DP, tp=TP)
    mesh = meshes.device_mesh
    out = []
    original = collectives.all_gather
    for kind, strategy, double in runs:
        torch.manual_seed(0)
        if kind == "megatron":
            net = Net(mesh["tp"].get_group())
        else:
            net = Net(megatron=False)
            tp_plan = {}
            for i in range(len(net.blocks)):
                tp_plan[f"blocks.{i}.up"] = ColwiseParallel()
                tp_plan[f"blocks.{i}.down"] = RowwiseParallel()
            parallelize_module(net, mesh["tp"], tp_plan)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        model, opt = fully_shard(
            net,
            opt,
            **meshes.fsdp_kwargs(),
            fsdp_unit_modules=[Block],
            zero_dp_strategy=strategy,
            fsdp_double_buffer=double,
        )
        meter = _gathered_meter(model.buffer)
        collectives.all_gather = meter.observe(original)
        try:
            for step in range(2):
                model.reset_comm_stats()
                meter.peak = 0
                g = torch.Generator().manual_seed(100 * step + model.dist_index.fsdp_rank)
                x = torch.randn(4, DIN, generator=g)
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        finally:
            collectives.all_gather = original
        out.append(((kind, strategy, double), model.memory_stats(), model.comm_stats(), meter.peak))
    return out


def _close(planned: float, measured: float) -> bool:
    return abs(planned - measured) <= 0.01 * max(abs(measured), 1)


def test_tp_plan_matches_memory_stats_comm_stats_and_gathered_peak():
    measured = run_distributed(_steps, WORLD, args=(RUNS,), timeout=120)
    for config in RUNS:
        _kind, strategy, double = config
        with torch.device("meta"):
            meta = Net()  # one tp rank's pieces, marked
        p = plan(
            meta,
            WORLD,
            tp=TP,
            fsdp_unit_modules=[Block],
            zero_dp_strategy=strategy,
            fsdp_double_buffer=double,
        )
        figures = [p.per_rank, *p.ranks.values()]
        for rank, results in enumerate(measured):
            ((got, comm, gathered),) = [(m, c, g) for cfg, m, c, g in results if cfg == config]
            where = f"tp {config}, rank {rank}"
            mine = [f for f in figures if _close(f["optimizer_state"], got["optimizer_state"])]
            assert mine, f"{where}: no planned rank has {got}; plan {figures}"
            for key in MODEL_STATE_KEYS:
                assert _close(mine[0][key], got[key]), (where, key, mine[0][key], got[key])
            assert _close(p.per_rank["gathered_peak"], gathered), (
                where, p.per_rank["gathered_peak"], gathered
            )  # fmt: skip
            for kind, counts in comm.items():
                if kind == "broadcast":
                    continue
                for field, value in counts.items():
                    assert _close(p.comm[kind][field], value), (
                        where, kind, field, p.comm[kind][field], value
                    )  # fmt: skip


def test_tp_bad_input_is_refused():
    with torch.device("meta"):
        meta = Net()
    with pytest.raises(ValueError, match="must divide world_size"):
        plan(meta, 6, tp=4)
    with pytest.raises(ValueError, match="tp must be a positive int"):
        plan(meta, 4, tp=0)
    # What the wrapper refuses, plan() refuses: tp with an expert mesh.
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        plan(meta, 8, tp=2, fsdp_unit_modules=[Block], ep=2)
