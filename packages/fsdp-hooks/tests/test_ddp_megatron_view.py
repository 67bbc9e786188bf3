"""``DistributedDataParallel(use_distributed_optimizer=True)`` as Megatron-Core's
``DistributedOptimizer`` reads it (megatron-core 0.19.2, non-FSDP path; the whole
optimizer is exercised in ``integration_tests/test_megatron_core_gpt.py``):

- Its ownership arithmetic: every bucket of ``model.buffers[i].buckets`` is cut into
  ``dp_size`` equal contiguous chunks of ``grad_data``; rank ``r`` owns chunk ``r``, and
  of each parameter the elements ``param_index_map`` places in that chunk. Applied to
  fsdp's view, the owned ranges cover every element of every trainable parameter
  exactly once over the ranks, and after ``finish_grad_sync`` the owned range of
  ``param.main_grad`` holds the gradient averaged over ranks (a one-process reference
  on the whole batch, fp32 within 1e-5).
- Its step writes this rank's range into ``bucket.param_data`` and calls
  ``model._start_bucket_group_param_sync(group)`` for every ``model.bucket_groups``
  entry: then every rank's parameters hold every rank's written rows, also for a bf16
  model whose fp32 main weights fsdp keeps apart (the written rows are what is
  gathered, not fsdp's stale main shard).
- Refused, on every rank, with what to do: the view of an all-reduce model, the view
  with ``overlap_param_gather`` (Megatron-Core then gathers in forward pre-hooks), and
  both Megatron-Core's optimizer and ``distributed_optimizer_params()`` on one model.

2 ranks, gloo, a 2-layer GPT of width 32 (several buckets).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from fsdp_hooks import DistributedDataParallel, DistributedDataParallelConfig
from fsdp_mesh.testing import run_distributed
from fsdp_mesh.testing.models import GPT, GPTConfig, token_batch

WORLD = 2
GLOBAL_BATCH = 8
SEQ_LEN = 8
VOCAB = 64
BUCKET = 3000  # elements: several buckets for the tiny GPT


def build_gpt(dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ_LEN, dim=32, n_heads=4, n_layers=2)
    return GPT(cfg).to(dtype)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def rank_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = token_batch(0, GLOBAL_BATCH, SEQ_LEN, VOCAB, seed=5)
    per_rank = GLOBAL_BATCH // WORLD
    return x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]


def _ddp(module: torch.nn.Module, **options: Any) -> DistributedDataParallel:
    cfg = DistributedDataParallelConfig(
        bucket_size=BUCKET, overlap_grad_reduce=True, use_distributed_optimizer=True, **options
    )
    return DistributedDataParallel(None, cfg, module)


def _owned_ranges(model: DistributedDataParallel) -> dict[torch.nn.Parameter, tuple[int, int]]:
    """Megatron-Core's arithmetic (DistributedOptimizer._build_model_gbuf_range): the
    element range of each parameter this rank owns."""
    rank, size = dist.get_rank(), dist.get_world_size()
    owned = {}
    for buffer in model.buffers:
        for bucket in buffer.buckets:
            numel = bucket.grad_data.numel()
            assert numel % size == 0, "Megatron-Core asserts equal chunks"
            chunk = numel // size
            lo = bucket.offset + rank * chunk
            hi = bucket.offset + min(numel, (rank + 1) * chunk)
            for param, (start, end, bucket_id) in buffer.param_index_map.items():
                if buffer.buckets[bucket_id] is not bucket:
                    continue
                a, b = max(start, lo), min(end, hi)
                if b > a:
                    owned[param] = (a - start, b - start)
    return owned


def _ownership_and_grads() -> dict[str, Any]:
    reference = build_gpt()
    x, y = token_batch(0, GLOBAL_BATCH, SEQ_LEN, VOCAB, seed=5)
    loss_fn(reference, x, y).backward()
    module = build_gpt()
    model = _ddp(module)
    loss_fn(model, *rank_batch(dist.get_rank())).backward()
    model.finish_grad_sync()
    owned = _owned_ranges(model)
    names = {p: n for n, p in module.named_parameters()}
    ref = dict(reference.named_parameters())
    counts, errors = {}, []
    for param, (a, b) in owned.items():
        name = names[param]
        counts[name] = (a, b)
        got = param.main_grad.view(-1)[a:b]
        want = ref[name].grad.view(-1)[a:b]
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            errors.append(name)
    return {"ranges": counts, "errors": errors, "numels": {n: p.numel() for n, p in ref.items()}}


def test_megatron_ownership_covers_each_element_once_and_holds_the_reduced_gradient():
    assert GLOBAL_BATCH % WORLD == 0
    outs = run_distributed(_ownership_and_grads, WORLD, timeout=120)
    numels = outs[0]["numels"]
    for name, numel in numels.items():
        pieces = sorted(out["ranges"][name] for out in outs if name in out["ranges"])
        covered = 0
        for a, b in pieces:
            assert a == covered, (name, pieces)
            covered = b
        assert covered == numel, (name, pieces, numel)
    assert all(not out["errors"] for out in outs), [out["errors"] for out in outs]


def _written_rows_reach_every_rank() -> dict[str, Any]:
    module = build_gpt(torch.bfloat16)  # fsdp keeps fp32 main weights apart
    model = _ddp(module, grad_reduce_in_fp32=True)
    assert any(g.main_weight_buffer is not None for g in model.buffer.groups)
    owned = _owned_ranges(model)
    names = {p: n for n, p in module.named_parameters()}
    index = {p: (buffer, bucket_id) for buffer in model.buffers
             for p, (_s, _e, bucket_id) in buffer.param_index_map.items()}  # fmt: skip
    with torch.no_grad():
        for param, (a, b) in owned.items():
            buffer, bucket_id = index[param]
            bucket = buffer.buckets[bucket_id]
            start = buffer.param_index_map[param][0] - bucket.offset
            # What the optimizer's step writes: a value known to every rank.
            values = _expected(names[param], param.numel())[a:b].to(param.dtype)
            bucket.param_data.view(-1)[start + a : start + b].copy_(values)
    for group in model.bucket_groups:
        model._start_bucket_group_param_sync(group, force_sync=False)
    return {
        n: bool(torch.equal(p.detach(), _expected(n, p.numel()).to(p.dtype).view(p.shape)))
        for n, p in module.named_parameters()
    }


def _expected(name: str, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(numel, generator=g)


def test_rows_written_into_param_data_reach_every_rank():
    for out in run_distributed(_written_rows_reach_every_rank, WORLD, timeout=120):
        assert out and all(out.values()), [n for n, ok in out.items() if not ok]


def _refusals() -> dict[str, str]:
    out = {}
    for label, make in {
        "all_reduce": lambda m: DistributedDataParallel(
            None, DistributedDataParallelConfig(use_distributed_optimizer=False), m
        ),
        "overlap_param_gather": lambda m: _ddp(m, overlap_param_gather=True),
    }.items():
        model = make(build_gpt())
        with pytest.raises(RuntimeError) as info:
            model.buffers[0].buckets  # noqa: B018 (what Megatron-Core's optimizer reads)
        out[label] = str(info.value)
    model = _ddp(build_gpt())
    model.buffers[0].buckets  # noqa: B018
    with pytest.raises(RuntimeError) as info:
        model.distributed_optimizer_params()
    out["megatron_then_fsdp"] = str(info.value)
    model = _ddp(build_gpt())
    model.distributed_optimizer_params()
    with pytest.raises(RuntimeError) as info:
        model.buffers[0].param_index_map  # noqa: B018
    out["fsdp_then_megatron"] = str(info.value)
    return out


def test_megatron_optimizer_refusals_say_what_to_do():
    for out in run_distributed(_refusals, WORLD, timeout=120):
        assert "use_distributed_optimizer=False in OptimizerConfig" in out["all_reduce"]
        assert "set overlap_param_gather=False" in out["overlap_param_gather"]
        assert "Megatron-Core's DistributedOptimizer" in out["megatron_then_fsdp"]
        assert "distributed_optimizer_params()" in out["megatron_then_fsdp"]
        assert "Use one optimizer per model" in out["fsdp_then_megatron"]
