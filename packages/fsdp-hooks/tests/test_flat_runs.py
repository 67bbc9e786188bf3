"""Flat runs of the local optimizer step (``fsdp_hooks.optim.flat_runs``, Note [flat runs]).

- State is created flat: the first step is local, on the runs, and each per-element key's
  pieces lie back to back (no copy into flat storage later, nothing left behind).
- Parity: units of a norm and an MLP (six small parameters each) under ZeRO-3, where each
  bucket's shards, gradients and state lie back to back, with AdamW (amsgrad), SGD with
  momentum, NAdam and ASGD: 5 steps against the same model and optimizer in one process
  on the whole batch (fp32, 1e-5), and bit for bit against the same run stepping one
  tensor per parameter; every step merges runs, and the gradient storage fsdp
  allocates anew each step is followed.
- The state keeps its contract: DTensors placed as their parameters, 0-d plain scalars,
  the same objects before and after, and its values equal to the per-tensor run's.
- A scalar written in place on one member (``state[p]["step"]``) is honoured: the run
  splits where the values differ, exactly as stepping one tensor per parameter does.
- Every stepped member's version counter moves (``ParamState`` reads them to install
  weights a step wrote without installing, ``install_optimized_model_weights=False``).
- A member whose gradient is None breaks its run and is skipped, as before; a member a
  step behind its neighbours stays out of their run.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_hooks import fully_shard
from fsdp_hooks.optim.flat_runs import Member, find_runs
from fsdp_mesh.testing import assert_tensors_close, run_distributed

STEPS = 5
BATCH = 8
DIM = 16


class _Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(_Unit() for _ in range(4)))


# eps 1e-3: Adam's first update is lr * g / (|g| + eps), whose sign follows gradient
# entries near zero, where the sum over ranks differs from one process's in the last bit.
OPTIMIZERS = {
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, amsgrad=True, eps=1e-3),
    "SGD": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01, eps=1e-3),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.01, t0=1),
}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)


def _rows() -> slice:
    rank, world = dist.get_rank(), dist.get_world_size()
    return slice(rank * BATCH // world, (rank + 1) * BATCH // world)


def _loss(model: nn.Module, step: int, rows: slice) -> torch.Tensor:
    x, y = _batch(step)
    return ((model(x[rows]) - y[rows]) ** 2).mean()


def _reference(opt_name: str) -> list[dict[str, torch.Tensor]]:
    model = _model()
    opt = OPTIMIZERS[opt_name](list(model.parameters()))
    out = []
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, step, slice(None)).backward()
        opt.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _wrap(opt_name: str, flatten: bool):
    module = _model()
    model, opt = fully_shard(
        module,
        OPTIMIZERS[opt_name](list(module.parameters())),
        fsdp_unit_modules=[_Unit],
        zero_dp_strategy=3,
    )
    opt._fsdp_local_step.flatten = flatten
    return model, opt


def _full(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.buffer.views.full_parameters().items()}


def _state(opt) -> dict[str, tuple[str, object]]:
    """Each state value: its kind and its local value (per parameter, by position)."""
    out = {}
    params = opt.param_groups[0]["params"]
    for i, p in enumerate(params):
        for key, value in opt.state[p].items():
            if isinstance(value, DTensor):
                assert value.placements == p.placements, (i, key)
                kind, local = "dtensor", value._local_tensor.clone()
            else:
                assert isinstance(value, torch.Tensor) and value.ndim == 0, (i, key)
                kind, local = "scalar", value.clone()
            out[f"{i}.{key}"] = (kind, local)
    return out


def _born_flat(opt) -> bool:
    """Each per-element state key's local pieces of the first bucket's parameters follow
    one another in one storage."""
    params = opt.param_groups[0]["params"][:12]
    for key, value in opt.state[params[0]].items():
        if not isinstance(value, DTensor):
            continue
        pieces = [opt.state[p][key]._local_tensor for p in params]
        for a, b in itertools.pairwise(pieces):
            if b.data_ptr() != a.data_ptr() + a.numel() * a.element_size():
                return False
    return True


def _train(opt_names: list[str]) -> dict:
    rows = _rows()
    out = {}
    for opt_name in opt_names:
        for flatten in (True, False):
            model, opt = _wrap(opt_name, flatten)
            params, runs, grad_ptrs, kept = [], [], [], []
            for step in range(STEPS):
                opt.zero_grad()
                _loss(model, step, rows).backward()
                grad = opt.param_groups[0]["params"][0].grad._local_tensor
                # Its storage held (the tensor itself follows the gradients to their next
                # storage), so the next step's cannot reuse the address.
                kept.append(grad.untyped_storage())
                grad_ptrs.append(grad.data_ptr())
                opt.step()
                if step == 0 and flatten:
                    out[(opt_name, "born_flat")] = _born_flat(opt)
                params.append(_full(model))
                runs.append(opt._fsdp_local_step.last_flat_runs)
            state_ids = [
                id(v) for p in opt.param_groups[0]["params"] for v in opt.state[p].values()
            ]
            out[(opt_name, flatten)] = (params, runs, _state(opt), state_ids, grad_ptrs)
            if flatten:  # the same state objects after more steps
                opt.zero_grad()
                _loss(model, STEPS, rows).backward()
                opt.step()
                after = [
                    id(v) for p in opt.param_groups[0]["params"] for v in opt.state[p].values()
                ]
                out[(opt_name, "same_objects")] = after == state_ids
    return out


def test_flat_runs_match_one_process_and_the_per_tensor_step():
    names = list(OPTIMIZERS)
    got = run_distributed(_train, 2, args=(names,), timeout=240)
    for opt_name in names:
        ref = _reference(opt_name)
        for rank_got in got:
            params, runs, state, _ids, grad_ptrs = rank_got[(opt_name, True)]
            born_flat = rank_got[(opt_name, "born_flat")]
            per_params, per_runs, per_state, _ids, _ptrs = rank_got[(opt_name, False)]
            # One run per bucket (two units by default: their twelve shards back to
            # back), from the first step, which creates the state flat; none when
            # stepping one tensor per parameter.
            assert runs == [2] * STEPS, (opt_name, runs)
            # Born flat: each per-element state key's pieces lie back to back.
            assert born_flat, opt_name
            assert per_runs == [0] * STEPS
            # fsdp allocated the gradient storage anew: the runs followed it.
            assert len(set(grad_ptrs)) == STEPS, grad_ptrs
            for step in range(STEPS):
                assert_tensors_close(params[step], ref[step], where=f"{opt_name} {step}")
                assert_tensors_close(
                    params[step], per_params[step], rtol=0, atol=0, where=f"{opt_name} {step}"
                )
            assert state.keys() == per_state.keys()
            for key, (kind, value) in state.items():
                assert kind == per_state[key][0], (opt_name, key)
                assert torch.equal(value, per_state[key][1]), (opt_name, key)
            assert rank_got[(opt_name, "same_objects")], opt_name


def _edits(flatten: bool) -> tuple:
    """One member's ``step`` written in place, a step that does not install, and a
    parameter without a gradient."""
    rows = _rows()
    model, opt = _wrap("AdamW", flatten)
    params = opt.param_groups[0]["params"]
    runs, moved = [], []
    out = []
    for step in range(STEPS + 2):
        opt.zero_grad()
        _loss(model, step, rows).backward()
        if step == 4:
            params[7].grad = None  # the second unit's LayerNorm bias: its run breaks
        before = [p._local_tensor._version for p in params]
        opt.step(install_optimized_model_weights=step != 3)
        # What ParamState reads to see the main weights written (it installs them at the
        # next forward when the step did not): every stepped parameter's counter moved.
        moved.append([b < p._local_tensor._version for b, p in zip(before, params, strict=True)])
        runs.append(opt._fsdp_local_step.last_flat_runs)
        out.append(_full(model))
        if step == 2:
            opt.state[params[2]]["step"].add_(5.0)  # in place: the same object
    steps = [float(opt.state[p]["step"]) for p in params]
    return out, runs, steps, moved


def _edits_both() -> dict:
    return {flatten: _edits(flatten) for flatten in (True, False)}


def test_flat_runs_honour_edits_between_steps():
    for got in run_distributed(_edits_both, 2, timeout=240):
        params, runs, steps, moved = got[True]
        per_params, _per_runs, per_steps, per_moved = got[False]
        assert moved == per_moved
        assert all(moved[3]) and moved[4].count(False) == 1, moved
        assert steps == per_steps
        assert steps[0] == STEPS + 2 and steps[2] == STEPS + 2 + 5 and steps[7] == STEPS + 1
        # Two buckets of two units (twelve parameters each), one run each.
        # Step 3: the first bucket splits around the edited step count (parameters 0-1
        # and 3-11; parameter 2 alone). Step 4: around parameter 7 too (no gradient).
        # After it, parameter 7 is a step behind its neighbours: the split stays.
        assert runs == [2, 2, 2, 3, 4, 4, 4], runs
        for step, (a, b) in enumerate(zip(params, per_params, strict=True)):
            assert_tensors_close(a, b, rtol=0, atol=0, where=f"edits {step}")


def test_find_runs_needs_members_that_follow_one_another():
    flat, grads = torch.zeros(10), torch.zeros(10)
    other = torch.zeros(4)

    def member(w: torch.Tensor, g: torch.Tensor, step: float = 1.0) -> Member:
        return Member(None, w, g, {"exp_avg": torch.zeros(w.shape), "step": torch.tensor(step)})

    members = [
        member(flat[0:2], grads[0:2]),
        member(flat[2:5], grads[2:5]),
        member(flat[5:7], grads[5:7]),  # follows
        member(flat[8:10], grads[7:9]),  # a gap in the weights
        member(flat[10:10], grads[9:9]),
        None,  # no gradient
        member(other[0:2], grads[0:2]),
        member(other[2:4], grads[2:4], step=2.0),  # another step count
    ]
    assert find_runs(members, frozenset({"exp_avg"})) == [range(0, 3), range(3, 5)]
    # At most max_numel elements a run: the first three hold 7.
    assert find_runs(members, frozenset({"exp_avg"}), max_numel=6) == [range(0, 2), range(3, 5)]
    assert find_runs(members, frozenset({"exp_avg"}), max_numel=7) == [range(0, 3), range(3, 5)]
