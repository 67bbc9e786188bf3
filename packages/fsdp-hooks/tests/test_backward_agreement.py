"""The end-of-backward agreement (``ParamState.agree``) meets other ranks only if any.

At the end of each backward the data-parallel ranks agree, in one MAX all-reduce, on
which parameters some rank's backward reached and which buckets got gradients after
their reduction; on CUDA that all-reduce and its read-back are a device sync. Over a
data-parallel group of one rank there is no one to agree with: in a world of one, and
under tensor parallelism alone (a (dp_shard 1, tp 2) mesh, world 2), the backward must
issue no MAX all-reduce (it used to issue one every backward), while a parameter no
backward reached still gets ``.grad`` None and training matches one process on the same
rows (losses, which parameters have a gradient, final weights). With two data-parallel
ranks it still issues exactly one, so the count below sees the agreement when it runs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from fsdp_hooks import fully_shard
from fsdp_mesh import build_device_mesh
from fsdp_mesh.testing import (
    assert_same_training,
    load_sibling,
    mean_over_ranks,
    run_distributed,
)

STEPS = 3
LR = 1e-2
STRATEGIES = (0, 1, 2, 3)
# name: (world size, data-parallel ranks, tp ranks)
MESHES = {"world1": (1, 1, 1), "tp_only": (2, 1, 2), "dp2": (2, 2, 1)}


# test_param_changes' model (two Block units and a layer no forward calls), seed and batches.
changes = load_sibling(__file__, "test_param_changes.py")
Block, build, batch, _with_grad = changes.Block, changes.build, changes.batch, changes._with_grad
ROWS, DIM = changes.ROWS, changes.DIM


@contextlib.contextmanager
def count_max_all_reduces() -> Iterator[list[int]]:
    """Count ``dist.all_reduce`` calls with ``op=MAX`` (the agreement's; reductions of
    gradients sum or average) while inside."""
    original = dist.all_reduce
    count = [0]

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op == dist.ReduceOp.MAX:
            count[0] += 1
        return original(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counting
    try:
        yield count
    finally:
        dist.all_reduce = original


def _train(mesh_name: str) -> dict:
    _world, dp, tp = MESHES[mesh_name]
    dp_rank = dist.get_rank() // tp
    out = {}
    for strategy in STRATEGIES:
        module = build()
        optimizer = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.1)
        mesh_args = {}
        if tp > 1:
            mesh = build_device_mesh(dp_shard=dp, tp=tp).device_mesh
            mesh_args = {"device_mesh": mesh, "dp_shard_dim": "dp_shard", "tp_dim": "tp"}
        model, optimizer = fully_shard(
            module, optimizer, fsdp_unit_modules=[Block], zero_dp_strategy=strategy, **mesh_args
        )
        losses, with_grad, agreements = [], [], []
        for step in range(STEPS):
            x, y = batch(step, dp_rank)
            loss = F.mse_loss(model(x), y)
            with count_max_all_reduces() as count:
                loss.backward()
            agreements.append(count[0])
            with_grad.append(_with_grad(model.module))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(mean_over_ranks(loss))
        out[strategy] = {
            "losses": losses,
            "with_grad": with_grad,
            "agreements": agreements,
            "params": model.buffer.views.full_parameters(),
        }
    return out


@functools.cache
def reference(dp: int) -> dict:
    """One process on the global batch: the mean of the data-parallel ranks' losses."""
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, with_grad = [], []
    for step in range(STEPS):
        loss = sum(F.mse_loss(model(x), y) for x, y in (batch(step, r) for r in range(dp))) / dp
        loss.backward()
        with_grad.append(_with_grad(model))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "with_grad": with_grad, "params": params}


@functools.cache
def trained(mesh_name: str) -> list[dict]:
    return run_distributed(_train, MESHES[mesh_name][0], args=(mesh_name,), timeout=120)


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: f"zero{s}")
def test_agreement_only_with_other_data_parallel_ranks(mesh_name, strategy):
    _world, dp, _tp = MESHES[mesh_name]
    ref = reference(dp)
    for rank, results in enumerate(trained(mesh_name)):
        got, where = results[strategy], f"{mesh_name} zero{strategy} rank {rank}"
        expected = 1 if dp > 1 else 0
        assert got["agreements"] == [expected] * STEPS, (where, got["agreements"])
        assert got["with_grad"] == ref["with_grad"], where
        assert all("unused.weight" not in names for names in got["with_grad"]), where
        assert_same_training(got, ref, where=where)


class _MoE(nn.Module):
    """One expert (``experts.0``: its own expert on each rank under expert parallelism)
    behind a shared input layer; ``use`` says whether this rank routes tokens to it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.experts = nn.ModuleList([nn.Linear(DIM, DIM)])

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        h = self.inp(x)
        return self.experts[0](h) if use else h


def _expert_unused_on_rank0(strategy: int) -> dict[str, object]:
    rank = dist.get_rank()
    meshes = build_device_mesh(dp_shard=2, expert_parallel=2)
    torch.manual_seed(rank)  # each rank's expert is its own
    module = _MoE()
    before = module.experts[0].weight.detach().clone()
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1, weight_decay=0.5)
    model, optimizer = fully_shard(
        module, optimizer, **meshes.fsdp_kwargs(), zero_dp_strategy=strategy
    )
    with count_max_all_reduces() as counted:
        model(torch.randn(ROWS, DIM), rank == 1).sum().backward()
    grads = {n: p.grad is not None for n, p in model.module.named_parameters()}
    optimizer.step()
    weight = model.module.experts[0].weight
    after = weight.full_tensor() if isinstance(weight, DTensor) else weight.detach()
    return {"grads": grads, "moved": not torch.equal(after, before), "max_all_reduces": counted[0]}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_expert_alone_in_its_expert_group_agrees_with_itself(strategy):
    """Experts differ across ranks and each expert's data-parallel group is one rank:
    the expert rank 0 routed no tokens to gets no gradient and AdamW leaves it as it
    was (as one process that holds it would), whatever the other rank's expert got;
    the shared layer agrees over both ranks."""
    out = run_distributed(_expert_unused_on_rank0, 2, args=(strategy,), timeout=120)
    assert out[0]["grads"] == {
        "inp.weight": True,
        "inp.bias": True,
        "experts.0.weight": False,
        "experts.0.bias": False,
    }, out[0]
    assert out[1]["grads"] == dict.fromkeys(out[1]["grads"], True), out[1]
    assert not out[0]["moved"] and out[1]["moved"], out
    assert out[0]["max_all_reduces"] == out[1]["max_all_reduces"] == 1, out
