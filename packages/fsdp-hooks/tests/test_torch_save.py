"""Plain ``torch.save`` / ``torch.load`` of ``model.state_dict()`` and
``optimizer.state_dict()`` on ``fully_shard``'s result (world size 2, ZeRO-0 to 3 and
hybrid sharding, AdamW), against one process (issue 40 item 2):

- right after wrapping, every entry of ``model.state_dict()`` saves (each rank its own
  file) and loads into a freshly wrapped model with other weights: it then holds the
  one-process initial weights;
- after a step, the model and optimizer state dicts save; a fresh model and optimizer
  ``load_state_dict`` them and two more steps equal the uninterrupted one-process run;
- the same for ``copy.deepcopy`` of both state dicts (a snapshot kept in memory while
  the model trains on). ``copy.deepcopy(model)`` stays refused (``module_copies``).

Several parameters share a bucket's flat buffer (a GPT block is one unit), so all but
the first are views at a storage offset (Note [picklable views] in ``dtensor_views``).
"""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp_hooks import fully_shard
from fsdp_mesh import build_device_mesh
from fsdp_mesh.testing import assert_tensors_close, run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

WORLD = 2
GLOBAL_BATCH = 8
CFG = GPTConfig(vocab_size=48, max_seq_len=8, dim=16, n_heads=2, n_layers=2)
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
CONFIGS = ("zero0", "zero1", "zero2", "zero3", "hsdp", "hsdp_optim")


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-3)


def _step(model, opt, step: int, rows: slice) -> None:
    x, y = token_batch(step, GLOBAL_BATCH, CFG.max_seq_len, CFG.vocab_size, seed=3)
    logits = model(x[rows])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[rows].flatten()).backward()
    opt.step()
    opt.zero_grad()


@functools.cache
def _reference() -> dict[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = _optimizer(model.parameters())
    out = {"init": {k: v.clone() for k, v in model.state_dict().items()}}
    _step(model, opt, 0, slice(None))
    out["one"] = {k: v.clone() for k, v in model.state_dict().items()}
    for step in (1, 2):
        _step(model, opt, step, slice(None))
    out["three"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def _wrap(config: str, seed: int):
    torch.manual_seed(seed)
    module = GPT(CFG)
    if config.startswith("hsdp"):
        extra = {
            "device_mesh": build_device_mesh(dp_outer=2, dp_shard=1).device_mesh,
            "dp_shard_dim": "dp_shard",
            "dp_outer_dim": "dp_outer",
            "outer_dp_sharding_strategy": "optim" if config.endswith("optim") else "no_shard",
        }
        strategy = 3
    else:
        extra, strategy = {}, int(config[-1])
    return fully_shard(
        module,
        _optimizer(module.parameters()),
        fsdp_unit_modules=[Block],
        zero_dp_strategy=strategy,
        **extra,
    )


def _full(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in get_model_state_dict(model, options=FULL).items()}


def _save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load(data: bytes):
    return torch.load(io.BytesIO(data))


def _run(config: str) -> dict:
    rank = dist.get_rank()
    rows = slice(rank * GLOBAL_BATCH // WORLD, (rank + 1) * GLOBAL_BATCH // WORLD)
    got: dict = {}
    model, opt = _wrap(config, seed=0)
    at_wrap = _save(model.state_dict())
    _step(model, opt, 0, rows)
    after_step = _save({"model": model.state_dict(), "optim": opt.state_dict()})

    fresh, fresh_opt = _wrap(config, seed=1)
    fresh.load_state_dict(_load(at_wrap))
    got["init"] = _full(fresh)

    # A snapshot in memory, as a "best model so far" is kept; the model then moves on.
    snapshot = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
    _step(model, opt, 1, rows)

    for how, state in (("save", _load(after_step)), ("deepcopy", snapshot)):
        fresh, fresh_opt = _wrap(config, seed=2)
        fresh.load_state_dict(state["model"])
        fresh_opt.load_state_dict(state["optim"])
        got[f"{how} one"] = _full(fresh)
        for step in (1, 2):
            _step(fresh, fresh_opt, step, rows)
        got[f"{how} three"] = _full(fresh)
    return got


@pytest.mark.parametrize("config", CONFIGS)
def test_torch_save_load_round_trip_resumes_at_parity(config):
    ref = _reference()
    got = run_distributed(_run, WORLD, args=(config,), timeout=120)[0]
    assert_tensors_close(got["init"], ref["init"], where=f"{config} saved at wrap, loaded")
    for how in ("save", "deepcopy"):
        where = f"{config} {how} after a step"
        assert_tensors_close(got[f"{how} one"], ref["one"], where=f"{where}, loaded")
        assert_tensors_close(got[f"{how} three"], ref["three"], where=f"{where}, two steps on")
