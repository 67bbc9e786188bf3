"""More than one autograd graph of the model in flight, under every strategy (world
size 2, SGD with momentum, parity with one process doing the same):

- a forward under ``torch.no_grad()`` (a metric, a teacher pass) between a training
  forward and its backward: it ends with no backward pending and releases everything,
  so the earlier graph's backward must gather its root buckets again;
- two forwards, then two backwards (``l1 = f(x1); l2 = f(x2); l1.backward();
  l2.backward()``): the first backward's end releases everything the second needs;
- the same, the second backward from a loss on a block's output (kept by a forward
  hook), which reaches no output of the model: no root pre-backward tells fsdp which
  unit calls it will backpropagate.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from fsdp_hooks import fully_shard
from fsdp_mesh.testing import assert_tensors_close, mean_over_ranks, run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

WORLD = 2
CFG = GPTConfig(vocab_size=48, max_seq_len=8, dim=16, n_heads=2, n_layers=3)
GLOBAL_BATCH = 8
STEPS = 3
PATTERNS = ("no_grad_forward_between", "two_forwards_two_backwards", "second_from_a_block_output")
# Unit coalescing (suggested_communication_unit_size, elements): large enough to join
# all three blocks into one communication unit sharing its buckets.
COALESCE = 1 << 20


def _loss(model, step: int, rows: slice) -> torch.Tensor:
    x, y = token_batch(step, GLOBAL_BATCH, CFG.max_seq_len, CFG.vocab_size, seed=3)
    return F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten())


def _step(model, pattern: str, step: int, rows: slice) -> float:
    """One step's backwards; returns what the pattern measures (the metric, or the
    second loss)."""
    if pattern == "no_grad_forward_between":
        loss = _loss(model, step, rows)
        with torch.no_grad():
            metric = _loss(model, 100 + step, rows)
        loss.backward()
        return metric.item()
    if pattern == "two_forwards_two_backwards":
        first, second = _loss(model, step, rows), _loss(model, 50 + step, rows)
        first.backward()
        second.backward()
        return second.item()
    first = _loss(model, step, rows)
    kept = []
    inner = getattr(model, "module", model)
    handle = inner.blocks[1].register_forward_hook(lambda _m, _a, out: kept.append(out))
    _loss(model, 50 + step, rows)
    handle.remove()
    first.backward()
    second = kept[0].pow(2).mean()
    second.backward()
    return second.item()


def _reference(pattern: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []
    for step in range(STEPS):
        seen.append(_step(model, pattern, step, slice(None)))
        opt.step()
        opt.zero_grad()
    return seen, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(pattern: str, coalesce: int | None) -> dict:
    rank = dist.get_rank()
    per_rank = GLOBAL_BATCH // WORLD
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    out = {}
    for strategy in (0, 1, 2, 3):
        torch.manual_seed(0)
        module = GPT(CFG)
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        model, opt = fully_shard(
            module,
            opt,
            fsdp_unit_modules=[Block],
            zero_dp_strategy=strategy,
            suggested_communication_unit_size=coalesce,
        )
        if coalesce:
            assert (0, 1, 2) in {g.coalesced_unit_ids for g in model.buffer.groups}
        seen = []
        for step in range(STEPS):
            seen.append(mean_over_ranks(_step(model, pattern, step, rows)))
            opt.step()
            opt.zero_grad()
        out[strategy] = (seen, model.buffer.views.full_parameters())
    return out


@pytest.mark.parametrize("coalesce", [None, COALESCE], ids=["units", "coalesced"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_graphs_in_flight_match_one_process(pattern, coalesce):
    """With coalesced units too: another graph's end of backward (or a forward without
    one) must not make a shared bucket look complete at its first unit's post-backward."""
    ref_seen, ref_params = _reference(pattern)
    got = run_distributed(_train, WORLD, args=(pattern, coalesce), timeout=120)[0]
    for strategy, (seen, params) in got.items():
        where = f"strategy {strategy} coalesce {coalesce}"
        torch.testing.assert_close(seen, ref_seen, rtol=1e-5, atol=0, msg=where)
        assert_tensors_close(params, ref_params, where=where)
