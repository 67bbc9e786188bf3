"""The local optimizer step (``fsdp_hooks.optim.local_step``, Note [local step]).

- Parity: Adam (plain, ``foreach``, ``fused``), AdamW and SGD with momentum under ZeRO-1/2/3
  (world 2) and HSDP, outer replicate and fully sharded (world 4), 4 steps of a model with
  an uneven shard, a 0-d parameter and an unused parameter (grad None), against the same
  model and optimizer in one process on the whole batch, step by step (fp32, 1e-5); every
  step must run locally, the first creating the state. Every other element-wise optimizer (Rprop is
  refused over a 0-d parameter) likewise under ZeRO-1/2/3, locally and on the DTensors.
- Against the DTensor step itself (an ``AdamW`` subclass is not stepped locally): every
  element-wise optimizer gives bit-identical weights and state, and the state has the same
  types and placements (DTensor per-element state, plain 0-d scalars).
- Hyperparameters set between steps (a scheduler, a group's ``lr`` and ``weight_decay``
  written by hand) and ``add_param_group`` are honoured.
- DCP: state saved after local steps loads (plain idiom and torch's state-dict API) into a
  fresh optimizer, whose first step then runs locally and continues the uninterrupted run,
  and (plain idiom) back into the optimizer that took more steps since the save.
- Fallbacks to the DTensor step: step hooks, a closure, state that is not placed as its
  parameter.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fsdp_hooks import fully_shard
from fsdp_mesh.testing import assert_tensors_close, run_distributed
from fsdp_mesh.versions import dtensor_masked_assign_keeps_shard

STEPS = 4
BATCH = 8


class _Model(nn.Module):
    """Rows that do not split evenly (5 over 2 or 4 ranks), a 0-d parameter, and a layer
    that never gets a gradient."""

    def __init__(self, scalar: bool = True) -> None:
        super().__init__()
        self.a = nn.Linear(8, 5)
        self.b = nn.Linear(5, 4)
        if scalar:
            self.scale = nn.Parameter(torch.tensor(1.5))
        else:
            self.register_buffer("scale", torch.tensor(1.5))
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) * self.scale


def _model(scalar: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return _Model(scalar)


# Refused at wrap over a 0-d parameter (its DTensor step indexes the 0-d DTensor with a
# boolean mask, which torch turns into a plain index tensor; test_optimizer_support
# tests the refusal). Tested here without the 0-d parameter.
_NO_SCALAR = {"Rprop"}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


class _AdamWSubclass(torch.optim.AdamW):
    """Not on the allowlist (a subclass may change the update): the DTensor step."""


OPTIMIZERS = {
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "Adam-foreach": lambda p: torch.optim.Adam(p, lr=0.01, foreach=True),
    "Adam-fused": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, amsgrad=True),
    "SGD": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "SGD-plain": lambda p: torch.optim.SGD(p, lr=0.05),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.01),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1),
    "Adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.01, t0=1),
}
# Refused at wrap before torch 2.15 (DTensor lacks its in-place masked assignment on a
# shard; test_optimizer_support tests the refusal).
if not dtensor_masked_assign_keeps_shard():
    del OPTIMIZERS["Rprop"]


def _rows(world: int) -> slice:
    rank = dist.get_rank()
    return slice(rank * BATCH // world, (rank + 1) * BATCH // world)


def _step(model, opt, step: int, rows: slice) -> None:
    x, y = _batch(step)
    opt.zero_grad()
    ((model(x[rows]) - y[rows]) ** 2).mean().backward()
    opt.step()


def _full(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.buffer.views.full_parameters().items()}


def _reference(opt_name: str, steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    model = _model()
    opt = OPTIMIZERS[opt_name](list(model.parameters()))
    out = []
    for step in range(steps):
        _step(model, opt, step, slice(None))
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


# ---- parity with one process --------------------------------------------------------------


def _wrap(opt_name: str, config: str):
    module = _model()
    opt = OPTIMIZERS[opt_name](list(module.parameters()))
    if config.startswith("hsdp"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
        return fully_shard(
            module,
            opt,
            device_mesh=mesh,
            dp_shard_dim="dp_shard",
            dp_outer_dim="dp_outer",
            zero_dp_strategy=3,
            outer_dp_sharding_strategy="optim" if config == "hsdp-optim" else "no_shard",
        )
    return fully_shard(module, opt, zero_dp_strategy=int(config.removesuffix("-dtensor")[-1]))


def _train(cases: list[tuple[str, str]], world: int) -> dict:
    out = {}
    for opt_name, config in cases:
        model, opt = _wrap(opt_name, config)
        if config.endswith("-dtensor"):  # the DTensor step of the same optimizer
            opt._fsdp_local_step._kind = None
        params, local = [], []
        for step in range(STEPS):
            _step(model, opt, step, _rows(world))
            params.append(_full(model))
            local.append(opt._fsdp_local_step.last_step_was_local)
        assert model.module.unused.weight.grad is None
        # The order in which the state lists its parameters (state_dict and DCP iterate
        # it), as positions in the groups.
        position = {
            id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])
        }
        order = [position[id(p)] for p in opt.state]
        out[(opt_name, config)] = (params, local, order)
    return out


def _check_parity(cases: list[tuple[str, str]], world: int) -> None:
    got = run_distributed(_train, world, args=(cases, world), timeout=240)
    for opt_name, config in cases:
        ref = _reference(opt_name)
        # The same on every rank, though their local shards differ.
        orders = [rank_got[(opt_name, config)][2] for rank_got in got]
        assert all(order == orders[0] for order in orders), (opt_name, config, orders)
        for rank_got in got:
            params, local, _order = rank_got[(opt_name, config)]
            # The first step creates the state on the local shards (written back as
            # DTensors; plain SGD keeps none).
            expected = [True] * STEPS
            if config.endswith("-dtensor"):
                expected = [False] * STEPS
            assert local == expected, (opt_name, config)
            for step in range(STEPS):
                assert_tensors_close(params[step], ref[step], where=f"{opt_name} {config} {step}")
            assert torch.equal(params[-1]["unused.weight"], _model().unused.weight)


def test_local_step_matches_one_process_zero123():
    cases = [
        (name, f"zero{s}") for name in ("Adam", "AdamW", "SGD", "SGD-plain") for s in (1, 2, 3)
    ]
    cases += [("Adam-foreach", "zero3"), ("Adam-fused", "zero3")]
    _check_parity(cases, 2)


def test_every_elementwise_optimizer_with_a_0d_parameter_matches_one_process():
    """Both the local and the DTensor step, under ZeRO-1/2/3, of a model with a 0-d
    parameter (replicated on every rank, its state alike). Adagrad's state from
    ``__init__`` was left a plain tensor on the 0-d parameter (mixed with DTensors)."""
    names = [n for n in OPTIMIZERS if n not in _NO_SCALAR and not n.startswith("Adam-")]
    cases = [
        (name, f"zero{s}{how}")
        for name in names
        for s in (1, 2, 3)
        for how in ("", "-dtensor")
        if how or name not in ("Adam", "AdamW", "SGD", "SGD-plain")  # tested above
    ]
    _check_parity(cases, 2)


def test_local_step_matches_one_process_hsdp():
    # Adagrad: its state from __init__ is placed on the 0-d parameter's 2-d mesh too.
    cases = [(name, c) for name in ("AdamW", "SGD", "Adagrad") for c in ("hsdp", "hsdp-optim")]
    _check_parity(cases, 4)


# ---- against the DTensor step -------------------------------------------------------------


def _state_summary(model, opt) -> dict[str, object]:
    """Per parameter name and key: (type, placements, local tensor or value)."""
    names = {id(p): n for n, p in model.buffer.views.optimizer_named_parameters()}
    out: dict[str, object] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state[p].items():
                if isinstance(value, DTensor):
                    assert value.placements == p.placements and value.shape == p.shape
                    out[f"{names[id(p)]}.{key}"] = ("DTensor", value._local_tensor.clone())
                else:
                    assert not isinstance(value, torch.Tensor) or value.ndim == 0, key
                    out[f"{names[id(p)]}.{key}"] = (type(value).__name__, value)
    return out


def _bitwise(names: list[str]) -> dict:
    out = {}
    for name in names:
        runs = []
        for local_on in (True, False):
            module = _model(scalar=name not in _NO_SCALAR)
            model, opt = fully_shard(module, OPTIMIZERS[name](list(module.parameters())))
            if not local_on:  # the DTensor step of the same optimizer
                opt._fsdp_local_step._kind = None
            local = []
            for step in range(STEPS):
                _step(model, opt, step, _rows(2))
                local.append(opt._fsdp_local_step.last_step_was_local)
            runs.append((_full(model), _state_summary(model, opt), local))
        out[name] = runs
    module = _model()
    model, opt = fully_shard(module, _AdamWSubclass(list(module.parameters()), lr=0.01))
    for step in range(2):
        _step(model, opt, step, _rows(2))
    out["subclass"] = opt._fsdp_local_step.last_step_was_local
    return out


def test_local_step_is_the_dtensor_step_bit_for_bit():
    names = [n for n in OPTIMIZERS if n != "Adam-fused"]
    got = run_distributed(_bitwise, 2, args=(names,), timeout=240)
    for rank_got in got:
        assert rank_got["subclass"] is False
        for name in names:
            (params, state, local), (ref_params, ref_state, ref_local) = rank_got[name]
            assert local[1:] == [True] * (STEPS - 1), name
            assert ref_local == [False] * STEPS, name
            assert params.keys() == ref_params.keys()
            for key in params:
                assert torch.equal(params[key], ref_params[key]), (name, key)
            assert state.keys() == ref_state.keys(), name
            for key, (kind, value) in state.items():
                ref_kind, ref_value = ref_state[key]
                assert kind == ref_kind, (name, key, kind, ref_kind)
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, ref_value), (name, key)
                else:
                    assert value == ref_value, (name, key)


# ---- hyperparameters and groups -------------------------------------------------------------


def _groups(module: nn.Module) -> list[dict]:
    """Weights with decay, biases and the scale without; ``b.bias`` joins later."""
    named = [(n, p) for n, p in module.named_parameters() if n != "b.bias"]
    return [
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0},
    ]


def _train_hparams(model, opt, late: nn.Parameter, rows: slice, local: list[bool]) -> list:
    """StepLR, plus hyperparameters written by hand and a group added between steps."""
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(STEPS + 2):
        x, y = _batch(step)
        opt.zero_grad()
        ((model(x[rows]) - y[rows]) ** 2).mean().backward()
        opt.step()
        sched.step()
        tracker = getattr(opt, "_fsdp_local_step", None)
        local.append(tracker.last_step_was_local if tracker else False)
        if step == 1:
            opt.param_groups[0]["weight_decay"] = 0.5
            opt.param_groups[1]["lr"] = 0.2
        if step == 2:
            opt.add_param_group({"params": [late], "lr": 0.3})
        if step == 4:
            opt.param_groups[2]["lr"] = 0.1
    return [g["lr"] for g in opt.param_groups]


def _hparams_sharded() -> tuple:
    module = _model()
    model, opt = fully_shard(module, torch.optim.AdamW(_groups(module), lr=0.05))
    # A group added after wrapping holds the DTensor parameter, as any other.
    late = dict(model.buffer.views.optimizer_named_parameters())["b.bias"]
    local: list[bool] = []
    lrs = _train_hparams(model, opt, late, _rows(2), local)
    return _full(model), lrs, local


def test_hyperparameters_set_between_steps_are_honoured():
    got = run_distributed(_hparams_sharded, 2, timeout=120)
    module = _model()
    opt = torch.optim.AdamW(_groups(module), lr=0.05)
    ref_lrs = _train_hparams(module, opt, module.b.bias, slice(None), [])
    ref = {n: p.detach().clone() for n, p in module.named_parameters()}
    for params_got, lrs, local in got:
        assert lrs == pytest.approx(ref_lrs)
        # Every step is local: the first, and the one after add_param_group (b.bias has
        # no state yet), create the state on the local shards.
        assert local == [True] * 6
        assert_tensors_close(params_got, ref, where="hyperparameters")


# ---- DCP -----------------------------------------------------------------------------------


def _dcp(root: str) -> dict:
    rows = _rows(2)
    out: dict = {}
    model, opt = _wrap("AdamW", "zero3")
    for step in range(2):
        _step(model, opt, step, rows)
    assert opt._fsdp_local_step.last_step_was_local
    dcp.save(
        {"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=f"{root}/plain"
    )
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/api")
    out["saved"] = _full(model)
    for step in range(2, STEPS):
        _step(model, opt, step, rows)
    out["uninterrupted"] = _full(model)

    for how in ("plain", "api", "same"):
        if how == "same":  # back into the optimizer that took the steps since the save
            fresh, fresh_opt = model, opt
        else:
            fresh, fresh_opt = _wrap("AdamW", "zero3")
            with torch.no_grad():  # other weights than the saved ones
                for p in fresh.module.parameters():
                    p.add_(1.0)
        if how in ("plain", "same"):
            state = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
            dcp.load(state, checkpoint_id=f"{root}/plain")
            fresh.load_state_dict(state["model"])
            fresh_opt.load_state_dict(state["optim"])
        else:
            msd, osd = get_state_dict(fresh, fresh_opt)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{root}/api")
            set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
        loaded = _full(fresh)
        local = []
        for step in range(2, STEPS):
            _step(fresh, fresh_opt, step, rows)
            local.append(fresh_opt._fsdp_local_step.last_step_was_local)
        out[how] = (loaded, _full(fresh), local)
    return out


def test_dcp_round_trip_after_local_steps(tmp_path):
    got = run_distributed(_dcp, 2, args=(str(tmp_path),), timeout=180)
    for rank_got in got:
        for how in ("plain", "api", "same"):
            loaded, params, local = rank_got[how]
            assert_tensors_close(loaded, rank_got["saved"], rtol=0, atol=0, where=how)
            # The loaded state is there before the first step: it runs locally at once.
            assert local == [True] * (STEPS - 2), how
            assert_tensors_close(params, rank_got["uninterrupted"], rtol=0, atol=0, where=how)


# ---- fallbacks ------------------------------------------------------------------------------


def _fallbacks() -> dict:
    rows = _rows(2)
    out = {}
    model, opt = _wrap("Adam", "zero3")
    _step(model, opt, 0, rows)
    seen: list[type] = []
    handle = opt.register_step_pre_hook(
        lambda o, _a, _k: seen.append(type(o.param_groups[0]["params"][0]))
    )
    _step(model, opt, 1, rows)
    out["hook"] = (opt._fsdp_local_step.last_step_was_local, seen)
    handle.remove()
    x, y = _batch(2)
    opt.zero_grad()
    ((model(x[rows]) - y[rows]) ** 2).mean().backward()
    opt.step(lambda: None)
    out["closure"] = opt._fsdp_local_step.last_step_was_local
    _step(model, opt, 3, rows)
    out["plain"] = opt._fsdp_local_step.last_step_was_local
    # State that is not a DTensor placed as its parameter (e.g. loaded from plain tensors).
    p = opt.param_groups[0]["params"][0]
    opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].full_tensor()
    out["plain_state"] = opt._fsdp_local_step._plan(opt) is None
    # A new DTensor in its place (same dict, new value) is the one the next step updates.
    fresh = torch.zeros_like(p)
    opt.state[p]["exp_avg"] = fresh
    _step(model, opt, 4, rows)
    out["replaced"] = (
        opt._fsdp_local_step.last_step_was_local,
        opt.state[p]["exp_avg"] is fresh,
        bool(fresh._local_tensor.abs().sum() > 0),
    )
    return out


def test_fallbacks_to_the_dtensor_step():
    for got in run_distributed(_fallbacks, 2, timeout=120):
        assert got["hook"] == (False, [DTensor])
        assert got["closure"] is False
        assert got["plain"] is True
        assert got["plain_state"] is True
        assert got["replaced"] == (True, True, True)


# ---- the reused plan ------------------------------------------------------------------------


def _edit(opt, step: int, phase: str) -> None:
    """Changes a reused plan must see, each made right after a step that reused it:
    a scalar state value rebound, a gradient replaced by a new tensor, a parameter
    removed from its group in place."""
    params = opt.param_groups[0]["params"]
    if step == 2 and phase == "after":
        opt.state[params[1]]["step"] = torch.tensor(1.0)
    if step == 5 and phase == "before_step":
        params[2].grad = params[2].grad * 0.5
    if step == 7 and phase == "after":
        del params[0]


def _train_edits(model, opt, rows: slice, reused: list[bool]) -> list[dict[str, torch.Tensor]]:
    out = []
    for step in range(10):
        x, y = _batch(step)
        opt.zero_grad()
        ((model(x[rows]) - y[rows]) ** 2).mean().backward()
        _edit(opt, step, "before_step")
        opt.step()
        tracker = getattr(opt, "_fsdp_local_step", None)
        if tracker is not None:
            reused.append(tracker.last_step_was_local and tracker.last_plan_was_reused)
            out.append(_full(model))
        else:
            out.append({n: p.detach().clone() for n, p in model.named_parameters()})
        _edit(opt, step, "after")
    return out


def _reused_plan() -> tuple:
    module = _model()
    model, opt = fully_shard(module, torch.optim.Adam(list(module.parameters()), lr=0.01))
    reused: list[bool] = []
    return _train_edits(model, opt, _rows(2), reused), reused


def test_a_reused_plan_sees_every_change():
    """The plan is reused between steps, and rebuilt (so the edit is honoured, in parity
    with one process) after each edit made to a step that reused it."""
    module = _model()
    ref = _train_edits(
        module, torch.optim.Adam(list(module.parameters()), lr=0.01), slice(None), []
    )
    for got, reused in run_distributed(_reused_plan, 2, timeout=120):
        for step, (params, ref_params) in enumerate(zip(got, ref, strict=True)):
            assert_tensors_close(params, ref_params, where=f"step {step}")
        # 0: the DTensor step (creates the state); 1: a new plan; 3, 5, 8: after the
        # edits; 6: the gradient is fsdp's own again (a new plan once more).
        assert reused == [False, False, True, False, True, False, False, True, False, True]
