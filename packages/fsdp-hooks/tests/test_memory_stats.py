"""``model.memory_stats()``: model-state bytes measured from the storages held.

On one rank under ``no_shard`` in fp32 everything is replicated and unpadded but for
the 16-element shard alignment, so the figures are known: the model weights once (the
main weights are the same storage, not counted again), the gradients once, AdamW's two
moments plus a 4-byte ``step`` per parameter; without an optimizer (none given, none
attached) there is no ``optimizer_state`` key; the optimizer given or attached is used."""

from __future__ import annotations

import pytest
import torch

from fsdp_hooks import fully_shard, fully_shard_model
from fsdp_mesh.testing import harness_device, run_distributed
from fsdp_mesh.testing.models import GPT, Block

# Runs on CUDA + NCCL under --fsdp-device cuda (root conftest.py).
pytestmark = pytest.mark.cuda


def _measure():
    torch.manual_seed(0)
    module = GPT()
    numel = sum(p.numel() for p in module.parameters())
    n_params = len(list(module.parameters()))
    bare = fully_shard_model(GPT(), fsdp_unit_modules=[Block], zero_dp_strategy=0)
    no_optimizer = bare.memory_stats()
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    model, opt = fully_shard(module, opt, fsdp_unit_modules=[Block], zero_dp_strategy=0)
    model(torch.zeros(2, 4, dtype=torch.long, device=harness_device())).sum().backward()
    opt.step()
    return numel, n_params, no_optimizer, model.memory_stats(), model.memory_stats(opt)


def test_memory_stats_on_one_rank():
    ((numel, n_params, bare, attached, given),) = run_distributed(_measure, 1)
    assert "optimizer_state" not in bare
    assert attached == given
    padded = attached["parameters"]
    assert 4 * numel <= padded < 4 * (numel + 16 * 8)  # a few buckets' alignment
    assert attached["main_weights"] == 0  # the model weights' storage, counted once
    assert attached["main_grads"] == padded
    assert attached["optimizer_state"] == 2 * 4 * numel + 4 * n_params
    assert attached["total"] == sum(v for k, v in attached.items() if k != "total")
