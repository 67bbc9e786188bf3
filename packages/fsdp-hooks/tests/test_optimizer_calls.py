"""Optimizer calls without a backward before them behave as in plain PyTorch, under
every strategy (world size 2, AdamW with weight decay, parity with one process): a
step right after wrapping or after ``zero_grad()`` (gradients None) skips every
parameter; after ``zero_grad(set_to_none=False)`` it applies zero gradients (decay and
momentum move the weights); two steps after one backward step twice."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn import functional as F

from fsdp_hooks import fully_shard
from fsdp_mesh.testing import assert_tensors_close, run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

WORLD = 2
CFG = GPTConfig(vocab_size=48, max_seq_len=8, dim=16, n_heads=2, n_layers=2)
GLOBAL_BATCH = 8
EPS = 1e-4  # the attention key bias's gradient is rounding noise: see test_adapters.py


def _script(model, opt, rows: slice) -> None:
    def backward(step: int) -> None:
        x, y = token_batch(step, GLOBAL_BATCH, CFG.max_seq_len, CFG.vocab_size, seed=3)
        F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten()).backward()

    opt.step()  # nothing yet: skipped
    backward(0)
    opt.step()
    opt.zero_grad()
    opt.step()  # gradients None: skipped
    backward(1)
    opt.step()
    opt.step()  # the same gradients again
    opt.zero_grad(set_to_none=False)
    opt.step()  # zero gradients: decay and momentum only


def _reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=EPS)
    _script(model, opt, slice(None))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train() -> dict:
    rank = dist.get_rank()
    per_rank = GLOBAL_BATCH // WORLD
    out = {}
    for strategy in (0, 1, 2, 3):
        torch.manual_seed(0)
        module = GPT(CFG)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1, eps=EPS)
        model, opt = fully_shard(module, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
        _script(model, opt, slice(rank * per_rank, (rank + 1) * per_rank))
        out[strategy] = model.buffer.views.full_parameters()
    return out


def test_steps_without_backward_match_plain_pytorch():
    ref = _reference()
    got = run_distributed(_train, WORLD, timeout=120)[0]
    for strategy, params in got.items():
        assert_tensors_close(params, ref, where=f"strategy {strategy}")
