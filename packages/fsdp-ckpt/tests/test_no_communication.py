"""Producing a state dict needs no communication: the model and optimizer state dicts
of an fsdp model (every strategy, world size 4, after a step so that the optimizer has
state) are DTensors over the local shards, built without a single collective, even
though the shards are uneven (some ranks hold no rows of some parameters)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn import functional as F

from fsdp_ckpt import get_model_state_dict, get_optimizer_state_dict
from fsdp_hooks import fully_shard
from fsdp_mesh.testing import run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

WORLD = 4
CFG = GPTConfig()
_C10D = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
         "broadcast", "broadcast_object_list", "reduce_scatter_tensor", "barrier",
         "all_to_all_single", "send", "recv", "gather_object", "scatter_object_list")  # fmt: skip


@contextlib.contextmanager
def _count_collectives():
    """Counts c10d calls (patched) and DTensor's functional collectives (CommDebugMode)."""
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in _C10D}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, counting(name, fn))
    try:
        with CommDebugMode() as mode:
            yield lambda: len(calls) + mode.get_total_counts()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _state_dicts_without_collectives() -> dict:
    rank = dist.get_rank()
    out = {}
    for strategy in (0, 1, 2, 3):
        torch.manual_seed(0)
        module = GPT(CFG)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
        model, opt = fully_shard(module, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
        x, y = token_batch(0, 2 * WORLD, CFG.max_seq_len, CFG.vocab_size)
        x, y = x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()

        with _count_collectives() as count:
            dist.all_reduce(torch.zeros(1))  # the counter sees a collective
            dist.all_gather_object([None] * WORLD, rank)
            assert count() >= 2
        with _count_collectives() as count:
            sd = model.state_dict()
            msd = get_model_state_dict(model)
            osd = get_optimizer_state_dict(model, opt)
            n = count()
        assert all(isinstance(t, DTensor) for t in sd.values())
        assert set(msd) == set(sd)
        state = osd["state"]
        assert state and all(isinstance(s["exp_avg"], DTensor) for s in state.values())
        sizes = {k: (t.to_local().numel(), t.numel()) for k, t in sd.items()}
        out[strategy] = (n, sizes)
    return out


def test_state_dicts_need_no_collective():
    results = run_distributed(_state_dicts_without_collectives, WORLD, timeout=120)
    for strategy in (0, 1, 2, 3):
        assert [r[strategy][0] for r in results] == [0] * WORLD, strategy
    # ZeRO-3 entries are sharded: their pieces add up to the whole parameter.
    for key, (_, numel) in results[0][3][1].items():
        assert sum(r[3][1][key][0] for r in results) == numel, key
