"""``DistributedDataParallel`` over a data-parallel group that is part of the world, as
Megatron-Core passes it beside tensor or pipeline groups: 4 ranks, two data-parallel
groups {0, 2} and {1, 3} (as with tensor parallelism of 2), each training its own
model on its own data. Each group trains exactly like torch's DDP over that group
(same losses and parameters, step by step, with accumulation under ``no_sync``), with
all-reduce and with the distributed optimizer; nothing crosses between the groups.
A rank given a group it is not in gets a clear error."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from fsdp_hooks import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from fsdp_mesh.testing import run_distributed
from fsdp_mesh.testing.models import GPT, GPTConfig, token_batch

WORLD = 4
TP = 2  # data-parallel groups: ranks with the same rank % TP
STEPS = 3
MICROBATCHES = 2
GROUP_BATCH = 4  # per microbatch, per data-parallel group
SEQ_LEN = 8
VOCAB = 64
LR = 1e-2
EPS = 1e-4  # see test_adapters.py
BUCKET = 3000
SETTINGS = {
    "all_reduce": {"use_distributed_optimizer": False},
    "distributed_optimizer": {"use_distributed_optimizer": True},
}


def _groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's data-parallel group, the other one); every rank makes both."""
    groups = [dist.new_group(list(range(t, WORLD, TP))) for t in range(TP)]
    mine = dist.get_rank() % TP
    return groups[mine], groups[1 - mine]


def _build() -> GPT:
    torch.manual_seed(dist.get_rank() % TP)  # each data-parallel group its own model
    return GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ_LEN, dim=32, n_heads=4, n_layers=2))


def _loss(model: nn.Module, step: int, micro: int, group: dist.ProcessGroup) -> torch.Tensor:
    seed = 10 + dist.get_rank() % TP  # each data-parallel group its own data
    x, y = token_batch(step * MICROBATCHES + micro, GROUP_BATCH, SEQ_LEN, VOCAB, seed=seed)
    per_rank = GROUP_BATCH // dist.get_world_size(group)
    mine = slice(dist.get_rank(group) * per_rank, (dist.get_rank(group) + 1) * per_rank)
    return F.cross_entropy(model(x[mine]).flatten(0, 1), y[mine].flatten())


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _torch_ddp(group: dist.ProcessGroup) -> dict[str, Any]:
    module = _build()
    model = torch.nn.parallel.DistributedDataParallel(module, process_group=group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        for micro in range(MICROBATCHES):
            last = micro == MICROBATCHES - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = _loss(model, step, micro, group)
                loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "params": _state(module)}


def _ours(group: dist.ProcessGroup, setting: dict[str, bool]) -> dict[str, Any]:
    module = _build()
    model = DistributedDataParallel(
        None,
        DistributedDataParallelConfig(bucket_size=BUCKET),
        module,
        data_parallel_group=group,
        overlap_grad_reduce=True,
        **setting,
    )
    assert model.data_parallel_group is not None
    assert dist.get_world_size(model.data_parallel_group) == WORLD // TP
    distributed = setting["use_distributed_optimizer"]
    params = model.distributed_optimizer_params() if distributed else list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        model.zero_grad_buffer()
        for micro in range(MICROBATCHES):
            last = micro == MICROBATCHES - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = _loss(model, step, micro, group)
                loss.backward()
            losses.append(loss.item())
        finalize_model_grads([model])
        if distributed:
            optimizer.step()
            model.start_param_sync()
        else:
            model.copy_main_grads_to_grads()
            optimizer.step()
            optimizer.zero_grad()
    return {"losses": losses, "params": _state(module)}


def _run() -> dict[str, Any]:
    mine, other = _groups()
    out: dict[str, Any] = {"torch": _torch_ddp(mine)}
    for name, setting in SETTINGS.items():
        out[name] = _ours(mine, setting)
    try:
        DistributedDataParallel(None, None, _build(), data_parallel_group=other)
    except ValueError as err:
        out["foreign_group"] = str(err)
    return out


def test_ddp_over_part_of_the_world_matches_torch_ddp():
    results = run_distributed(_run, WORLD, timeout=180)
    for rank, out in enumerate(results):
        ref = out["torch"]
        for name in SETTINGS:
            got = out[name]
            torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=0)
            for key, expected in ref["params"].items():
                torch.testing.assert_close(
                    got["params"][key],
                    expected,
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, k=key, n=name, r=rank: f"rank {r} {n} {k}: {m}",
                )
        assert "not in the data_parallel_group" in out["foreign_group"], out["foreign_group"]
    # One model per group: the same on ranks 0 and 2, another on ranks 1 and 3.
    for name in SETTINGS:
        p = [out[name]["params"]["tok.weight"] for out in results]
        assert torch.equal(p[0], p[2]) and torch.equal(p[1], p[3]), name
        assert not torch.allclose(p[0], p[1]), name
