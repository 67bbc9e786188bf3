"""Every ``torch.optim`` optimizer either steps fsdp's main weights as one process
steps the whole model, or is refused at wrap naming why (``fsdp_hooks.optim.optimizers``);
LR schedulers built after ``fully_shard`` (the usual order) work.

Parity: world size 2, ZeRO-3 (and the other strategies for some), 3 steps of a two-layer MLP whose shapes
split evenly over the ranks, each rank on its half of a global batch, against the
same model and optimizer in one process on the whole batch (fp32, 1e-5). Rprop over a
0-d parameter is refused unless ``capturable`` (which then matches one process); before
torch 2.15, Rprop unless ``capturable`` over any parameter.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim import rprop

from fsdp_hooks import fully_shard
from fsdp_mesh.testing import assert_tensors_close, run_distributed
from fsdp_mesh.versions import dtensor_masked_assign_keeps_shard

WORLD = 2
STEPS = 3
BATCH = 8
STRATEGIES = (0, 1, 2, 3)

_Factory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, _Factory] = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.01),
    # Creates its state in __init__ (it used to be refused as "already holds state").
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1),
    "Adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.01, t0=1),
}
# Refused before torch 2.15 (test_unsupported_optimizers_are_refused_on_every_rank).
RPROP_STEPS = dtensor_masked_assign_keeps_shard()
if not RPROP_STEPS:
    del OPTIMIZERS["Rprop"]
# Need whole matrices: under 1-3 fully_shard places them whole on one rank each (Note
# [whole placement] in fsdp_buffers.layout; more in test_whole_matrix.py).
WHOLE_MATRIX: dict[str, _Factory] = {
    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01),
    # 1-D parameters only: its relative step and update clipping use each tensor's RMS,
    # which a row piece does not have (it trained 0.85% off when row-sharded).
    "Adafactor-1d": lambda p: torch.optim.Adafactor([q for q in p if q.ndim == 1], lr=0.01),
}
if hasattr(torch.optim, "Muon"):
    WHOLE_MATRIX["Muon"] = lambda p: torch.optim.Muon([q for q in p if q.ndim == 2], lr=0.01)

SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], object]] = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=0.05, total_steps=STEPS + 1
    ),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def _train(model, opt, sched, rows: slice) -> list[float]:
    lrs = []
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        ((model(x[rows]) - y[rows]) ** 2).mean().backward()
        opt.step()
        if sched is not None:
            sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def _reference(make_opt: _Factory, make_sched=None) -> tuple[dict, list[float]]:
    model = _model()
    opt = make_opt(list(model.parameters()))
    sched = make_sched(opt) if make_sched else None
    lrs = _train(model, opt, sched, slice(None))
    return {n: p.detach().clone() for n, p in model.named_parameters()}, lrs


def _sharded(cases: list[tuple[str, str | None, int]]) -> dict:
    rank = dist.get_rank()
    rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    out = {}
    for opt_name, sched_name, strategy in cases:
        module = _model()
        make = OPTIMIZERS.get(opt_name) or WHOLE_MATRIX[opt_name]
        model, opt = fully_shard(module, make(list(module.parameters())), zero_dp_strategy=strategy)
        sched = SCHEDULERS[sched_name](opt) if sched_name else None  # after fully_shard
        lrs = _train(model, opt, sched, rows)
        out[(opt_name, sched_name, strategy)] = (model.buffer.views.full_parameters(), lrs)
    return out


def _check(cases: list[tuple[str, str | None, int]]) -> None:
    got = run_distributed(_sharded, WORLD, args=(cases,), timeout=180)[0]
    for opt_name, sched_name, strategy in cases:
        make = OPTIMIZERS.get(opt_name) or WHOLE_MATRIX[opt_name]
        ref, ref_lrs = _reference(make, SCHEDULERS[sched_name] if sched_name else None)
        params, lrs = got[(opt_name, sched_name, strategy)]
        where = f"{opt_name} {sched_name or ''} strategy {strategy}"
        assert lrs == pytest.approx(ref_lrs), where
        assert_tensors_close(params, ref, where=where)


def test_every_elementwise_optimizer_matches_one_process():
    """Each under ZeRO-3; Adagrad (state from ``__init__`` moved onto the shards) and
    Adam under every strategy."""
    cases = [(name, None, 3) for name in OPTIMIZERS]
    cases += [(name, None, s) for name in ("Adagrad", "Adam") for s in STRATEGIES[:-1]]
    _check(cases)


def test_whole_matrix_optimizers_match_one_process_under_every_strategy():
    _check([(name, None, s) for name in WHOLE_MATRIX for s in (0, 1, 2, 3)])


def test_lr_schedulers_built_after_fully_shard():
    """torch's LRScheduler wraps ``optimizer.step`` through its ``__func__``: the
    patched step must stay a bound method (it raised AttributeError)."""
    _check([("AdamW", name, s) for name in SCHEDULERS for s in (0, 3)])
    _check([("SGD", "StepLR", 1)])


def _with_0d() -> nn.Module:
    module = _model()
    module.register_parameter("scale", nn.Parameter(torch.tensor(1.5)))
    return module


def _with_frozen_0d() -> nn.Module:
    module = _with_0d()
    module.scale.requires_grad_(False)
    return module


def _refused(factory: _Factory, strategy: int, make_model=_model) -> list[str]:
    module = make_model()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    opt = factory(list(module.parameters()))
    try:
        fully_shard(module, opt, zero_dp_strategy=strategy)
    except TypeError as exc:
        # Refused before anything was sharded: the module is as it was.
        after = dict(module.named_parameters())
        assert all(type(p) is nn.Parameter for p in after.values())
        assert all(torch.equal(after[n], before[n]) for n in before)
        return [str(exc)]
    return []


def _all_refusals() -> list[list[str]]:
    out = [
        _refused(lambda p: torch.optim.LBFGS(p), 0),
        _refused(lambda p: torch.optim.SparseAdam(p), 0),
    ]
    # A 0-d parameter, under every strategy (no_shard steps a replicated DTensor too).
    out += [_refused(lambda p: torch.optim.Rprop(p), s, _with_0d) for s in STRATEGIES]
    out.append(_refused(lambda p: torch.optim.Rprop(p), 3, _with_frozen_0d))  # not stepped
    out.append(_refused(lambda p: torch.optim.Rprop(p), 3))  # no 0-d parameter
    return out


def test_unsupported_optimizers_are_refused_on_every_rank():
    per_rank = run_distributed(_all_refusals, WORLD, timeout=120)
    assert per_rank[0] == per_rank[1]
    lbfgs, sparse_adam, *zero_d, frozen_0d, plain = per_rank[0]
    assert len(zero_d) == len(STRATEGIES), per_rank[0]  # whole-matrix ones are placed
    assert all(len(m) == 1 for m in (lbfgs, sparse_adam, *zero_d)), per_rank[0]
    assert "LBFGS is not supported" in lbfgs[0] and "closure" in lbfgs[0]
    assert "SparseAdam is not supported" in sparse_adam[0] and "sparse" in sparse_adam[0]
    if RPROP_STEPS:
        for message in zero_d:
            assert "Rprop cannot step a 0-d parameter" in message[0], message
        assert frozen_0d == plain == [], per_rank[0]  # a frozen 0-d parameter is not stepped
    else:  # any Rprop (not capturable) on an older torch, naming the torch it needs
        for message in [*zero_d, frozen_0d, plain]:
            assert len(message) == 1, per_rank[0]
            assert "Rprop cannot step fsdp's main weights on torch" in message[0], message
            assert "from torch 2.15" in message[0] and "capturable=True" in message[0]


class _Counting(torch.optim.Optimizer):
    """Not a torch optimizer: fsdp does not know its state keys."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.1})
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["seen"] = torch.zeros_like(p)

    def step(self, closure=None):
        return None


def _unknown_0d_state() -> list[str]:
    messages = []
    for make in (_model, _with_0d):
        module = make()
        try:
            fully_shard(module, _Counting(list(module.parameters())))
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_unknown_0d_state_of_a_0d_parameter_is_refused_on_every_rank():
    """Whether a 0-d tensor of an unknown optimizer's state is per-element or a scalar
    cannot be told for a 0-d parameter: refused, not guessed (nd state is moved)."""
    per_rank = run_distributed(_unknown_0d_state, WORLD, timeout=120)
    assert per_rank[0] == per_rank[1]
    assert len(per_rank[0]) == 1, per_rank[0]
    assert "'seen'" in per_rank[0][0] and "0-d parameter" in per_rank[0][0], per_rank[0]


def _cpu_too(supports_xla: bool = True) -> list[str]:
    # torch allows capturable=True only on accelerators; its update (torch.where instead
    # of boolean indexing) is the same on CPU, which is what these tests have.
    return ["cpu"]


def _allow_capturable_on_cpu() -> None:
    """In a worker process (its own interpreter)."""
    rprop._get_capturable_supported_devices = _cpu_too


def _capturable_rprop(cases: list[tuple[int, bool]]) -> dict:
    _allow_capturable_on_cpu()
    rank = dist.get_rank()
    rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    out = {}
    for strategy, local in cases:
        module = _with_0d()
        model, opt = fully_shard(
            module,
            torch.optim.Rprop(list(module.parameters()), lr=0.01, capturable=True),
            zero_dp_strategy=strategy,
        )
        if not local:  # the DTensor step
            opt._fsdp_local_step._kind = None
        for step in range(STEPS):
            x, y = _batch(step)
            opt.zero_grad()
            ((model(x[rows]) * model.module.scale - y[rows]) ** 2).mean().backward()
            opt.step()
        out[(strategy, local)] = model.buffer.views.full_parameters()
    return out


def test_capturable_rprop_steps_a_0d_parameter_as_one_process(monkeypatch):
    """``capturable`` Rprop does not index with a boolean mask: it is not refused over a
    0-d parameter, and both the local and the DTensor step match one process."""
    cases = [(s, local) for s in (1, 2, 3) for local in (True, False)]
    got = run_distributed(_capturable_rprop, WORLD, args=(cases,), timeout=120)[0]
    monkeypatch.setattr(rprop, "_get_capturable_supported_devices", _cpu_too)
    module = _with_0d()
    opt = torch.optim.Rprop(list(module.parameters()), lr=0.01, capturable=True)
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        ((module(x) * module.scale - y) ** 2).mean().backward()
        opt.step()
    ref = {n: p.detach().clone() for n, p in module.named_parameters()}
    assert ref["scale"] != 1.5
    for case in cases:
        assert_tensors_close(got[case], ref, where=f"capturable Rprop {case}")
