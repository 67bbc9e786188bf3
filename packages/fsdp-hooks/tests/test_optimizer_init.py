"""``fully_shard`` creates the optimizer state before the first step (as Megatron-FSDP's
``fully_shard_optimizer`` does), so that a fresh model + optimizer is a target for
plain ``dcp.load`` (world size 2, strategies 0 and 3, against one process):

- right after wrapping, every trainable parameter has state: Adam/AdamW moments and
  SGD momentum buffers are zeros, ``step`` is 0, the weights are untouched;
- training from there equals training a fresh one-process optimizer (SGD with
  ``dampening`` included, whose first step differs between "no buffer" and "zero
  buffer": the created state is dropped by the first step unless something was loaded);
- ``dcp.save`` of ``optimizer.state_dict()`` after one step, ``dcp.load`` into a fresh
  optimizer's ``state_dict()`` and ``load_state_dict``: the next step equals the
  uninterrupted run's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from fsdp_hooks import fully_shard
from fsdp_mesh.testing import assert_tensors_close, run_distributed

WORLD = 2
GLOBAL_BATCH = 8
OPTIMIZERS = ("adam", "adamw", "sgd", "sgd_dampening")
STRATEGIES = (0, 3)


def _build(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 4, bias=False))


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2, weight_decay=0.1, eps=1e-3)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-3)
    dampening = 0.5 if kind == "sgd_dampening" else 0.0
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=dampening, weight_decay=0.1)


def _step(model, opt, step: int, rows: slice) -> None:
    g = torch.Generator().manual_seed(10 + step)
    x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
    nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
    opt.step()
    opt.zero_grad()


def _reference(kind: str) -> list[dict[str, torch.Tensor]]:
    model = _build()
    opt = _optimizer(kind, model.parameters())
    out = [{k: v.clone() for k, v in model.state_dict().items()}]
    for step in range(2):
        _step(model, opt, step, slice(None))
        out.append({k: v.clone() for k, v in model.state_dict().items()})
    return out


def _full(model) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def _fresh_state(model, opt) -> dict[str, dict[str, float]]:
    """Per parameter: each state entry's largest magnitude (step: its value)."""
    out = {}
    for name, p in model.named_parameters():
        state = opt.state.get(p, {})
        out[name] = {
            key: float(value.to_local().abs().max() if hasattr(value, "to_local") else value)
            for key, value in state.items()
        }
    return out


def _run(root: str) -> dict:
    rank = dist.get_rank()
    rows = slice(rank * GLOBAL_BATCH // WORLD, (rank + 1) * GLOBAL_BATCH // WORLD)
    out = {}
    for kind in OPTIMIZERS:
        for strategy in STRATEGIES:
            got = out[kind, strategy] = {}
            module = _build()
            model, opt = fully_shard(
                module,
                _optimizer(kind, module.parameters()),
                fsdp_unit_modules=[nn.Linear],
                zero_dp_strategy=strategy,
            )
            got["state"] = _fresh_state(model, opt)
            got["weights"] = [_full(model)]
            _step(model, opt, 0, rows)
            got["weights"].append(_full(model))
            path = f"{root}/{kind}-{strategy}"
            dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
            _step(model, opt, 1, rows)
            got["weights"].append(_full(model))

            module = _build(seed=1)
            fresh, fresh_opt = fully_shard(
                module,
                _optimizer(kind, module.parameters()),
                fsdp_unit_modules=[nn.Linear],
                zero_dp_strategy=strategy,
            )
            state = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
            dcp.load(state, checkpoint_id=path)
            fresh.load_state_dict(state["model"])
            fresh_opt.load_state_dict(state["optim"])
            _step(fresh, fresh_opt, 1, rows)
            got["resumed"] = _full(fresh)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("optim_init"))
    return run_distributed(_run, WORLD, args=(root,), timeout=300)[0]


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_fresh_state_is_zero_at_step_zero(results, kind):
    expected_keys = {"adam": {"step", "exp_avg", "exp_avg_sq"}, "adamw": None}
    expected_keys["adamw"] = expected_keys["adam"]
    for strategy in STRATEGIES:
        state = results[kind, strategy]["state"]
        assert set(state) == {"0.weight", "2.weight"}, state
        for name, entries in state.items():
            keys = expected_keys.get(kind, {"momentum_buffer"})
            assert set(entries) == keys, (kind, strategy, name, entries)
            assert all(v == 0.0 for v in entries.values()), (kind, strategy, name, entries)


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_training_and_resuming_match_one_process(results, kind):
    ref = _reference(kind)
    for strategy in STRATEGIES:
        got = results[kind, strategy]
        for step, (weights, expected) in enumerate(zip(got["weights"], ref, strict=True)):
            assert_tensors_close(weights, expected, where=f"{kind} zero{strategy} step {step}")
        assert_tensors_close(got["resumed"], ref[2], where=f"{kind} zero{strategy} resumed")
