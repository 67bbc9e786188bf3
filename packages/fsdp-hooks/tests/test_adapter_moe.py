"""Megatron-Core's ``FullyShardedDataParallel`` with a MoE transformer config.

Megatron-Core's adapter gives a model whose config sets ``num_moe_experts`` an expert
mesh built from its parallel state (its tests check ``expt_device_mesh is not None``).
Ours builds it from what it is given: the world (no pg_collection; expert parallelism of
one rank), a pg_collection's ``expt_dp`` group, or the hybrid layout of
``num_distributed_optimizer_instances``. Expert parameters then live on the expert mesh,
and ``test_expert``'s MoE trains like one process. A dense config gets no expert mesh.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from fsdp_hooks import FullyShardedDataParallel, fully_shard_optimizer
from fsdp_mesh.testing import load_sibling, run_distributed

toy = load_sibling(__file__, "test_expert.py")
WORLD = 2


def _job(layout: str):
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = toy.Net()
    config = SimpleNamespace(num_moe_experts=None if layout == "dense" else toy.N_EXPERTS)
    ddp = {"data_parallel_sharding_strategy": "optim_grads_params"}
    pg = None
    if layout == "pg_collection":
        pg = SimpleNamespace(dp_cp=dist.group.WORLD, expt_dp=dist.new_group([0, 1]))
    if layout == "hybrid":
        ddp["num_distributed_optimizer_instances"] = 2
    model = FullyShardedDataParallel(
        config, ddp, net, fsdp_unit_modules=[toy.MoE], pg_collection=pg
    )
    opt = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=toy.LR, momentum=0.9))
    index = model.megatron_fsdp_dist_index
    buf = model.module.buffer
    expert_names = sorted(n for g in buf.groups if g.is_expert_param for n in g.names)
    per = toy.WORLD * toy.TOKENS // WORLD
    losses = []
    for step in range(toy.STEPS):
        x, y = toy._batch(step)
        rows = slice(rank * per, (rank + 1) * per)
        loss = F.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        model.finish_grad_sync()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / WORLD)
    return {
        "has_expert_mesh": index.expt_device_mesh is not None,
        "expert_names": expert_names,
        "losses": losses,
        "params": buf.views.full_parameters(),
    }


@pytest.mark.parametrize("layout", ["world", "pg_collection", "hybrid", "dense"])
def test_moe_config_builds_expert_mesh(layout):
    ref_losses, ref_params = toy._reference()
    for out in run_distributed(_job, WORLD, args=(layout,), timeout=120):
        assert out["has_expert_mesh"] is (layout != "dense"), (layout, out["has_expert_mesh"])
        if layout != "dense":
            assert out["expert_names"] and all(
                n.startswith("moe.experts.") for n in out["expert_names"]
            )
        torch.testing.assert_close(out["losses"], ref_losses, rtol=1e-5, atol=0)
        for name, ref in ref_params.items():
            torch.testing.assert_close(out["params"][name], ref, rtol=1e-5, atol=1e-6)
