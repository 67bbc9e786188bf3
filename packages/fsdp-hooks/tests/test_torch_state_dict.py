"""torch's state-dict API and plain DCP on ``fully_shard``'s result and the FSDP adapter
(world size 2, every strategy, AdamW with weight decay), against one process:

- ``get_model_state_dict`` / ``get_optimizer_state_dict`` with ``full_state_dict=True``
  (and ``cpu_offload``) after a step equal the one-process weights and Adam moments,
  under the wrapped module's names;
- ``get_state_dict`` -> ``dcp.save`` -> a fresh model (other weights) + optimizer ->
  ``dcp.load`` -> ``set_state_dict`` restores every value, and the next step equals the
  uninterrupted one-process run's;
- the plain idiom ``dcp.save({"model": model.state_dict(), "optim":
  optimizer.state_dict()})`` and back (``load_state_dict`` on both) does the same: the
  fresh optimizer has state to load into before its first step;
- ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` loads the
  one-process weights;
- ``set_state_dict(full_state_dict=True)`` of ``get_state_dict(full_state_dict=True)``
  into a fresh pair restores weights and moments, and the next step matches.

The "even" model has one parameter per bucket with dim-0 sizes divisible by 2, so its
shards are ``torch.chunk`` pieces today; the "uneven" one (tied GPT) needs the chunk
layout of issue 14.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from fsdp_hooks import FullyShardedDataParallel, fully_shard, fully_shard_optimizer
from fsdp_mesh.testing import assert_tensors_close, run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

WORLD = 2
GLOBAL_BATCH = 8
LR, WD, EPS = 1e-2, 0.1, 1e-3
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
GPT_CFG = GPTConfig(vocab_size=48, max_seq_len=8, dim=16, n_heads=2, n_layers=2)
CONFIGS = ("zero0", "zero1", "zero2", "zero3", "adapter")


class Net(nn.Module):
    """Attribute paths a user reaches through the wrapper: ``config``, ``generate``,
    ``model.layers``."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(dim=8)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(2))
        self.head = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = torch.tanh(layer(x))
        return self.head(x)

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x).argmax(-1)


def _build(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Net() if kind == "even" else GPT(GPT_CFG)


def _units(kind: str) -> list[type[nn.Module]]:
    return [nn.Linear] if kind == "even" else [Block]


def _loss(kind: str, model: nn.Module, step: int, rows: slice) -> torch.Tensor:
    if kind == "even":
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
        return nn.functional.mse_loss(model(x[rows]), y[rows])
    x, y = token_batch(step, GLOBAL_BATCH, GPT_CFG.max_seq_len, GPT_CFG.vocab_size, seed=3)
    logits = model(x[rows])
    return nn.functional.cross_entropy(logits.flatten(0, 1), y[rows].flatten())


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD, eps=EPS)


def _step(kind: str, model, opt, step: int, rows: slice) -> None:
    _loss(kind, model, step, rows).backward()
    opt.step()
    opt.zero_grad()


@functools.cache
def _reference(kind: str) -> dict:
    model = _build(kind, 0)
    opt = _optimizer(model.parameters())
    _step(kind, model, opt, 0, slice(None))
    names = {p: n for n, p in model.named_parameters()}
    moments = {
        f"{names[p]}.{key}": value.clone()
        for p, state in opt.state.items()
        for key, value in state.items()
        if key != "step"
    }
    after_one = {k: v.clone() for k, v in model.state_dict().items()}
    _step(kind, model, opt, 1, slice(None))
    return {"one": after_one, "moments": moments, "two": dict(model.state_dict())}


def _wrap(kind: str, config: str, seed: int):
    module = _build(kind, seed)
    if config == "adapter":
        ddp_config = {"data_parallel_sharding_strategy": "optim_grads_params"}
        model = FullyShardedDataParallel(None, ddp_config, module, fsdp_unit_modules=_units(kind))
        return model, fully_shard_optimizer(_optimizer(model.parameters()))
    strategy = int(config[-1])
    return fully_shard(
        module,
        _optimizer(module.parameters()),
        fsdp_unit_modules=_units(kind),
        zero_dp_strategy=strategy,
    )


def _full(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in get_model_state_dict(model, options=FULL).items()}


def _moments(model, opt) -> dict[str, torch.Tensor]:
    osd = get_optimizer_state_dict(model, opt, options=FULL)
    return {
        f"{name}.{key}": value.clone()
        for name, state in osd.get("state", {}).items()  # cpu_offload: rank 0 only
        for key, value in state.items()
        if key != "step"
    }


def _run(kind: str, root: str) -> dict:
    rank = dist.get_rank()
    per_rank = GLOBAL_BATCH // WORLD
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    out: dict = {}
    for config in CONFIGS:
        got = out[config] = {}
        model, opt = _wrap(kind, config, seed=0)
        _step(kind, model, opt, 0, rows)
        got["one"], got["moments"] = _full(model), _moments(model, opt)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/{config}-api")
        dcp.save(
            {"model": model.state_dict(), "optim": opt.state_dict()},
            checkpoint_id=f"{root}/{config}-plain",
        )

        # torch's API into a fresh model and optimizer (other weights, no step yet).
        fresh, fresh_opt = _wrap(kind, config, seed=1)
        msd, osd = get_state_dict(fresh, fresh_opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=f"{root}/{config}-api")
        set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
        got["api_loaded"], got["api_moments"] = _full(fresh), _moments(fresh, fresh_opt)
        _step(kind, fresh, fresh_opt, 1, rows)
        got["api_two"] = _full(fresh)

        # The plain idiom.
        plain, plain_opt = _wrap(kind, config, seed=2)
        state = {"model": plain.state_dict(), "optim": plain_opt.state_dict()}
        dcp.load(state, checkpoint_id=f"{root}/{config}-plain")
        plain.load_state_dict(state["model"])
        plain_opt.load_state_dict(state["optim"])
        got["plain_loaded"] = _full(plain)
        _step(kind, plain, plain_opt, 1, rows)
        got["plain_two"] = _full(plain)

        # A full state dict, broadcast from rank 0.
        bcast, _ = _wrap(kind, config, seed=3)
        full = _reference_on_rank0(kind) if rank == 0 else {}
        set_model_state_dict(
            bcast, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        )
        got["broadcast"] = _full(bcast)

        # Full model and optimizer state dicts (on every rank) into a fresh pair.
        whole = StateDictOptions(full_state_dict=True)
        full_model, full_optim = get_state_dict(model, opt, options=whole)
        again, again_opt = _wrap(kind, config, seed=4)
        set_state_dict(
            again,
            again_opt,
            model_state_dict=full_model,
            optim_state_dict=full_optim,
            options=whole,
        )
        got["full_loaded"], got["full_moments"] = _full(again), _moments(again, again_opt)
        _step(kind, again, again_opt, 1, rows)
        got["full_two"] = _full(again)
    return out


def _reference_on_rank0(kind: str) -> dict[str, torch.Tensor]:
    return dict(_reference(kind)["one"])  # a copy: torch's loader fills it in place


@pytest.mark.parametrize(
    "kind",
    [
        "even",
        "uneven",
    ],
)
def test_torch_state_dict_api_and_plain_dcp_round_trip(kind, tmp_path):
    ref = _reference(kind)
    got = run_distributed(_run, WORLD, args=(kind, str(tmp_path)), timeout=300)[0]
    for config, res in got.items():
        where = f"{kind} {config}"
        assert set(res["one"]) == set(ref["one"]), where  # the wrapped module's names
        assert_tensors_close(res["one"], ref["one"], where=f"{where} after one step")
        assert_tensors_close(res["moments"], ref["moments"], where=f"{where} moments")
        for how in ("api", "plain", "full"):
            assert_tensors_close(res[f"{how}_loaded"], ref["one"], where=f"{where} {how} load")
            assert_tensors_close(res[f"{how}_two"], ref["two"], where=f"{where} {how} next step")
        for how in ("api", "full"):
            assert_tensors_close(res[f"{how}_moments"], ref["moments"], where=f"{where} {how}")
        assert_tensors_close(res["broadcast"], ref["one"], where=f"{where} broadcast")
