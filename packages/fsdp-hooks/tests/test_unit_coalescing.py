"""Unit coalescing (``suggested_communication_unit_size``) and ``prefetch_depth``.

Consecutive FSDP units are joined, in registration order, into communication units of
at least ``suggested_communication_unit_size`` elements that share their buckets
(Note [communication units] in ``fsdp_buffers.param_group``). Checked here, world size
2 on gloo (4 for HSDP), against one process on the same data, step by step (losses and
full parameters after every step, fp32 within 1e-5):

- ZeRO-1/2/3, HSDP, recompute (reentrant and not), a frozen unit, double buffering,
  microbatches under ``no_sync``, meta-device init, units run out of registration
  order: training matches one process, and so does ``model.state_dict()``;
- the collectives per step drop as expected: under ZeRO-3, two all-gathers per
  communication unit (forward, backward) plus one per root bucket, and one
  reduce-scatter per trainable communication unit plus the root's;
- prefetch: only the first communication unit of each pass misses, nothing is wasted;
  with ``prefetch_depth=0`` every one misses, and depth 2 gathers the same number of
  times as depth 1.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from fsdp_buffers.collectives import CollectiveKind
from fsdp_buffers.param_group import coalesce_units, resolve_communication_units
from fsdp_hooks import fully_shard
from fsdp_mesh import build_device_mesh
from fsdp_mesh.testing import assert_tensors_close, run_distributed

DIM = 8
UNITS = 7
STEPS = 3
GLOBAL_BATCH = 4
# Elements of one Unit: LayerNorm (2·DIM) + Linear (DIM·DIM + DIM).
UNIT_NUMEL = 2 * DIM + DIM * DIM + DIM


class Unit(nn.Module):
    """A norm and a linear layer, as a small transformer block has."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Stack(nn.Module):
    """An input layer outside every unit (a root bucket), then ``UNITS`` units."""

    def __init__(
        self, recompute: str = "none", frozen: int | None = None, order: list[int] | None = None
    ) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.units = nn.ModuleList(Unit() for _ in range(UNITS))
        self.recompute = recompute
        self.order = list(range(UNITS)) if order is None else order
        if frozen is not None:
            self.units[frozen].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for unit in (self.units[i] for i in self.order):
            if self.recompute == "none":
                x = unit(x)
            else:
                x = checkpoint(unit, x, use_reentrant=self.recompute == "reentrant")
        return x


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, DIM, generator=g)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _reference(recompute: str, frozen: int | None, microbatches: int, order=None):
    torch.manual_seed(0)
    model = Stack(recompute, frozen, order)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses, params = [], []
    for step in range(STEPS):
        x = _batch(step)
        total = 0.0
        for chunk in x.chunk(microbatches):
            loss = _loss(model, chunk) / microbatches
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, params


def _train(case: dict):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    with torch.device("meta") if case.get("meta") else contextlib.nullcontext():
        module = Stack(case.get("recompute", "none"), case.get("frozen"), case.get("order"))
    opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.1)
    kwargs = {"init_model_with_meta_device": True} if case.get("meta") else {}
    if case.get("hsdp"):
        kwargs.update(
            device_mesh=build_device_mesh(dp_outer=2, dp_shard=2).device_mesh,
            dp_shard_dim="dp_shard",
            dp_outer_dim="dp_outer",
        )
    model, opt = fully_shard(
        module,
        opt,
        fsdp_unit_modules=[Unit],
        zero_dp_strategy=case.get("zero", 3),
        fsdp_double_buffer=case.get("double_buffer", False),
        suggested_communication_unit_size=case.get("size", 0),
        prefetch_depth=case.get("depth", 1),
        **kwargs,
    )
    pipeline = model.all_gather_pipeline
    microbatches = case.get("microbatches", 1)
    per_rank = GLOBAL_BATCH // world
    losses, params, gathers, reduces, misses, wasted = [], [], [], [], [], []
    for step in range(STEPS):
        before = pipeline.prefetch_misses, pipeline.wasted_prefetches
        model.buffer.stats.reset()
        x = _batch(step)[rank * per_rank : (rank + 1) * per_rank]
        total = torch.zeros(())
        chunks = x.chunk(microbatches)
        for i, chunk in enumerate(chunks):
            loss = _loss(model, chunk) / microbatches
            if i < len(chunks) - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
            total += loss.detach()
        stats = model.buffer.stats
        gathers.append(stats[CollectiveKind.ALL_GATHER].calls)
        reduces.append(
            stats[CollectiveKind.REDUCE_SCATTER].calls + stats[CollectiveKind.ALL_REDUCE].calls
        )
        misses.append(pipeline.prefetch_misses - before[0])
        wasted.append(pipeline.wasted_prefetches - before[1])
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        params.append(model.buffer.views.full_parameters())
    # The state dict's DTensors are per parameter: grouping must not show in them.
    state = {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()
    }
    groups = model.buffer.groups
    root = set(model.hooks.root_groups)
    comm_units = {groups[g].fsdp_unit_id for g in range(len(groups)) if g not in root}
    return dict(
        losses=losses,
        params=params,
        state=state,
        gathers=gathers,
        reduces=reduces,
        misses=misses,
        wasted=wasted,
        comm_units=len(comm_units - {None}),
        unit_buckets=sum(b.is_distributed for b in model.buffer.buckets if b.gid not in root),
        root=len(root),
    )


def _check_parity(case: dict, out: dict) -> None:
    losses, params = _reference(
        case.get("recompute", "none"),
        case.get("frozen"),
        case.get("microbatches", 1),
        case.get("order"),
    )
    for step in range(STEPS):
        where = f"{case}, step {step}"
        assert math.isclose(out["losses"][step], losses[step], rel_tol=1e-5), where
        assert_tensors_close(out["params"][step], params[step], where=where)
    assert_tensors_close(out["state"], params[-1], where=f"{case}, state_dict")


def test_coalesce_units_groups_consecutive_units_until_the_size():
    assert coalesce_units([10] * 5, None) == [0, 1, 2, 3, 4]
    assert coalesce_units([10] * 5, 0) == [0, 1, 2, 3, 4]
    assert coalesce_units([10] * 5, 20) == [0, 0, 2, 2, 4]
    assert coalesce_units([10] * 5, 25) == [0, 0, 0, 3, 3]
    assert coalesce_units([50, 10, 10, 50, 10], 20) == [0, 1, 1, 3, 4]
    assert coalesce_units([10] * 3, 10**9) == [0, 0, 0]
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="non-negative number of elements"):
            coalesce_units([10], bad)
    # At most ``max_units`` per group (the default's pairs), whichever limit comes first.
    assert coalesce_units([10] * 5, 10**9, 2) == [0, 0, 2, 2, 4]
    assert coalesce_units([10] * 7, 25, 2) == [0, 0, 2, 2, 4, 4, 6]
    assert coalesce_units([10] * 7, 15, 3) == [0, 0, 2, 2, 4, 4, 6]
    assert coalesce_units([50, 10, 10, 10, 50], 10**9, 1) == [0, 1, 2, 3, 4]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive number of units"):
            coalesce_units([10], 20, bad)


def test_the_default_pairs_small_units_and_leaves_large_ones():
    size, most = resolve_communication_units(None)
    assert (size, most) == (65_536, 2)
    small, block = 33_216, 7_000_000  # a norm + MLP unit of the benchmark; a real block
    assert coalesce_units([small] * 5, size, most) == [0, 0, 2, 2, 4]
    assert coalesce_units([4_160] * 4, size, most) == [0, 0, 2, 2]
    assert coalesce_units([block] * 3, size, most) == [0, 1, 2]
    assert resolve_communication_units(0) == (0, None)
    assert resolve_communication_units(8_192) == (8_192, None)  # a chosen size: no cap


def test_below_zero3_the_default_joins_up_to_four_small_units():
    """Nothing stays gathered below ZeRO-3, so the default joins more: groups of at
    least 131,072 elements, of at most four units; a chosen size is the same under
    every strategy."""
    size, most = resolve_communication_units(None, shards_model_weights=False)
    small, block = 33_216, 7_000_000
    assert coalesce_units([small] * 9, size, most) == [0, 0, 0, 0, 4, 4, 4, 4, 8]
    assert coalesce_units([4_160] * 9, size, most) == [0, 0, 0, 0, 4, 4, 4, 4, 8]
    assert coalesce_units([block] * 3, size, most) == [0, 1, 2]
    assert resolve_communication_units(0, False) == (0, None)
    assert resolve_communication_units(8_192, False) == (8_192, None)


# Units per communication unit -> the size that makes it.
PER_GROUP = (1, 2, 3, UNITS)


def _size(k: int) -> int:
    return 0 if k == 1 else k * UNIT_NUMEL


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_coalesced_training_matches_one_process_and_counts_collectives(zero):
    cases = [dict(zero=zero, size=_size(k)) for k in PER_GROUP]
    outs = run_distributed(_many, 2, args=(cases,), timeout=120)[0]
    for k, case, out in zip(PER_GROUP, cases, outs, strict=True):
        _check_parity(case, out)
        groups = math.ceil(UNITS / k)
        assert out["comm_units"] == groups, (case, out["comm_units"])
        assert out["root"] == 1, out["root"]
        # One reduction per communication unit and one for the root bucket.
        assert out["reduces"] == [groups + 1] * STEPS, (case, out["reduces"])
        if zero == 3:
            # Two gathers per communication unit (forward, backward), the root once.
            assert out["gathers"] == [2 * groups + 1] * STEPS, (case, out["gathers"])
            assert out["misses"][1:] == [2] * (STEPS - 1), (case, out["misses"])
            assert out["wasted"] == [0] * STEPS, (case, out["wasted"])
        else:
            # Below ZeRO-3 the weight sync after the step gathers each bucket once:
            # with overlap_param_gather (the default) in the next forward, the root
            # bucket at the root pre-forward (Note [stale buckets]).
            assert out["gathers"] == [0] + [groups + 1] * (STEPS - 1), (case, out["gathers"])


def _many(cases: list[dict]) -> list[dict]:
    return [_train(case) for case in cases]


COMBINED = [
    dict(size=_size(2), recompute="reentrant"),
    dict(size=_size(3), recompute="non_reentrant"),
    dict(size=_size(2), frozen=2),
    dict(size=_size(3), frozen=0),
    dict(size=_size(2), double_buffer=True),
    dict(size=_size(3), microbatches=2),
    dict(size=_size(2), zero=2, microbatches=2),
    dict(size=_size(3), meta=True),
]


def test_coalescing_with_recompute_frozen_units_double_buffer_no_sync_and_meta_init():
    outs = run_distributed(_many, 2, args=(COMBINED,), timeout=120)[0]
    for case, out in zip(COMBINED, outs, strict=True):
        _check_parity(case, out)
        if case.get("zero", 3) == 3 and case.get("microbatches", 1) == 1:
            # A frozen unit's parameters have a bucket of their own in its communication
            # unit. Recompute gathers once for both the recompute and the backward.
            buckets = out["unit_buckets"]
            assert buckets == out["comm_units"] + ("frozen" in case), (case, buckets)
            assert out["gathers"] == [2 * buckets + 1] * STEPS, (case, out["gathers"])
            assert out["wasted"] == [0] * STEPS, (case, out["wasted"])


def test_coalescing_under_hsdp():
    cases = [dict(hsdp=True, size=_size(2)), dict(hsdp=True, size=_size(3), zero=2)]
    outs = run_distributed(_many, 4, args=(cases,), timeout=120)[0]
    for case, out in zip(cases, outs, strict=True):
        _check_parity(case, out)


@pytest.mark.parametrize("k", [1, 2])
def test_prefetch_depth_counts(k):
    """Depth 0 gathers each communication unit when asked (every one misses); depth 1
    and 2 miss only the first of each pass; all gather the same number of times and
    waste nothing; training matches one process."""
    cases = [dict(size=_size(k), depth=d) for d in (0, 1, 2)]
    outs = run_distributed(_many, 2, args=(cases,), timeout=120)[0]
    groups = math.ceil(UNITS / k)
    for case, out in zip(cases, outs, strict=True):
        _check_parity(case, out)
        assert out["gathers"] == [2 * groups + 1] * STEPS, (case, out["gathers"])
        assert out["wasted"] == [0] * STEPS, (case, out["wasted"])
        expected = 2 * groups if case["depth"] == 0 else 2
        assert out["misses"][1:] == [expected] * (STEPS - 1), (case, out["misses"])


def test_bad_prefetch_depth_is_refused_on_every_rank():
    results = run_distributed(_bad_depth, 2, timeout=60)
    for messages in results:
        assert "prefetch_depth must be >= 0" in messages[0], messages
        assert "prefetch_depth must be int" in messages[1], messages
        assert "non-negative number of elements" in messages[2], messages


def _bad_depth() -> list[str]:
    out = []
    for kwargs in (
        dict(prefetch_depth=-1),
        dict(prefetch_depth=1.5),
        dict(suggested_communication_unit_size=-3),
    ):
        module = Stack()
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        try:
            fully_shard(module, opt, fsdp_unit_modules=[Unit], **kwargs)
        except (ValueError, TypeError) as e:
            out.append(str(e))
        else:
            out.append("no error")
    return out


SHUFFLED = [3, 0, 5, 1, 6, 4, 2]


def test_units_run_out_of_registration_order():
    """Groups follow registration order; a model that interleaves the units of
    different groups still trains like one process (each group is gathered once per
    pass, and held until all its units ran). With double buffering that would need a
    third slot: a clear error on every rank."""
    case = dict(size=_size(2), order=SHUFFLED)
    (out,) = run_distributed(_many, 2, args=([case],), timeout=120)[0]
    _check_parity(case, out)
    assert out["gathers"] == [2 * 4 + 1] * STEPS, out["gathers"]
    assert out["wasted"] == [0] * STEPS, out["wasted"]
    for message in run_distributed(_double_buffer_error, 2, timeout=60):
        assert "fsdp_double_buffer: slot" in message and "still held" in message, message


def _double_buffer_error() -> str:
    try:
        _train(dict(size=_size(2), order=SHUFFLED, double_buffer=True))
    except RuntimeError as e:
        return str(e)
    return "no error"


def _adapter() -> dict:
    from fsdp_hooks import DistributedDataParallelConfig, FullyShardedDataParallel

    torch.manual_seed(0)
    cfg = DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params",
        suggested_communication_unit_size=_size(3),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = FullyShardedDataParallel(None, cfg, Stack(), fsdp_unit_modules=[Unit])
    groups = model.module.buffer.groups
    return dict(
        units=sorted({g.fsdp_unit_id for g in groups if g.fsdp_unit_id is not None}),
        warned=[str(w.message) for w in caught if "suggested_communication" in str(w.message)],
    )


def test_megatron_core_adapter_takes_the_ddp_config_field():
    """``ddp_config.suggested_communication_unit_size`` coalesces under the Megatron-Core
    adapter too, without the "no effect" warning it used to give."""
    for out in run_distributed(_adapter, 2, timeout=60):
        assert out["units"] == [0, 3, 6], out
        assert out["warned"] == [], out


def _coalescing_warnings() -> list[list[str]]:
    out = []
    for size in (None, 0, _size(2), _size(UNITS), 400_000_000):
        module = Stack()
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fully_shard(
                module, opt, fsdp_unit_modules=[Unit], suggested_communication_unit_size=size
            )
        out.append([str(w.message) for w in caught if "communication unit of" in str(w.message)])
    return out


def test_a_group_of_most_of_the_model_is_reported_on_every_rank():
    """A size that joins units into a group of more than half of the units' parameters
    (a value tuned for Megatron-FSDP's prefetch, hundreds of millions) warns on every
    rank: under ZeRO-3 that group is gathered and held at once. Pairs, no coalescing
    and the default do not (the default joins at most two units, so it is not checked)."""
    for per_rank in run_distributed(_coalescing_warnings, 2, timeout=120):
        default, off, pairs, whole, megatron = per_rank
        assert default == off == pairs == [], per_rank
        for caught in (whole, megatron):
            assert len(caught) == 1, caught
            assert f"joins {UNITS} FSDP units" in caught[0] and "pass 0" in caught[0], caught
