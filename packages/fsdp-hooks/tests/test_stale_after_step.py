"""ZeRO-1/2 weights left stale by the optimizer step and gathered by the next forward
(Note [stale buckets] in ``fsdp_buffers.all_gather_pipeline``).

With ``overlap_param_gather`` (``fully_shard``'s default) the optimizer step marks the
buckets whose install is an all-gather STALE, and the forward's ordinary gather path
gathers them with forward prefetch. Whatever a user does between the step and that
forward, or during it, training must be what it is when the step gathers everything
itself: the same losses and weights, bit for bit, and the one-process reference's within
1e-5. The cases: writes to the main weights after the step (with and without a
main-weight buffer of their own), a state dict loaded after the step, an eval forward, a
forward that raises half-way, units run out of registration order, a unit skipped on one
rank only, units under activation checkpointing (reentrant or not), a parameter of a unit
written inside the forward before the unit runs, and a unit's submodule called from
outside the unit before the unit runs. Then: the gathers are issued in the forward, each
unit's prefetched by the unit before it, and a broadcast between the step and the
forward keeps the step.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from fsdp_buffers import BucketStatus, MixedPrecisionPolicy
from fsdp_hooks import fully_shard
from fsdp_mesh.testing import assert_same_training, mean_over_ranks, run_distributed

WORLD = 2
STEPS = 4
ROWS = 4
DIM = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Model(nn.Module):
    """Root layers around four blocks. ``order`` runs the blocks in another order than
    they are registered in; ``skip`` leaves one out; ``peek`` calls block 2's linear
    layer from the root's forward before block 2 runs."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(DIM, 2)
        self.order = [0, 1, 2, 3]
        self.skip: int | None = None
        self.peek = False
        self.fail_in: int | None = None
        self.write_in_forward = False
        self.checkpoint: bool | None = None  # activation checkpointing: use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.write_in_forward:  # idempotent: the reference runs a forward per rank
            with torch.no_grad():
                self.blocks[1].fc.bias.clamp_(-0.05, 0.05)  # its gather is in flight
        if self.peek:  # no gradient path outside the unit: that alone raises
            with torch.no_grad():
                h = h + self.blocks[2].fc(h)
        for i in self.order:
            if i == self.fail_in:
                raise ValueError("a forward that raises half-way")
            if i == self.skip:
                continue
            if self.checkpoint is None:
                h = self.blocks[i](h)
            else:
                h = checkpoint(self.blocks[i], h, use_reentrant=self.checkpoint)
        return self.head(h)


def build() -> Model:
    torch.manual_seed(0)
    return Model()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(ROWS, DIM, generator=g), torch.randn(ROWS, 2, generator=g)


def between(model: nn.Module, step: int, saved: dict | None) -> None:
    """What a user does after the step and before the next forward, on the module's
    parameters (DTensors when wrapped), as the reference does on its plain module:
    in-place writes, and a state dict of an earlier step loaded."""
    with torch.no_grad():
        if step == 0:
            for p in model.parameters():
                p.mul_(0.5)
            model.blocks[1].fc.weight.data.add_(0.25)  # through .data
    if step == 1 and saved is not None:
        model.load_state_dict(saved)


def _configure(model: Model, scenario: str) -> None:
    if scenario == "order":
        model.order = [2, 0, 3, 1]
    model.write_in_forward = scenario == "write_in_forward"
    if scenario.startswith("checkpoint"):
        model.checkpoint = scenario == "checkpoint_reentrant"


def _train(strategy: int, overlap: bool, scenario: str, precision: str) -> dict:
    rank = dist.get_rank()
    module = build()
    _configure(module, scenario)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    model, optimizer = fully_shard(
        module,
        optimizer,
        fsdp_unit_modules=[Block],
        zero_dp_strategy=strategy,
        overlap_param_gather=overlap,
        mixed_precision_policy=policy,
        # Pairs of blocks (88 elements each) share a bucket; one bucket per block otherwise.
        suggested_communication_unit_size=150 if scenario in ("order", "skip") else 0,
    )
    inner = model.module
    losses: list[float] = []
    saved = None
    for step in range(STEPS):
        x, y = batch(step, rank)
        if scenario == "skip" and rank == 0 and step % 2 == 1:
            inner.skip = 1  # rank 0 leaves block 1 out; rank 1 runs it
        inner.peek = scenario == "peek"
        try:
            out = model(x)
        except RuntimeError as err:
            # Block 2's parameters are its DTensors until its pre-forward gathers them,
            # so torch raises where the stale compute weights would give a wrong value.
            assert scenario == "peek" and overlap, err
            return {"peek_error": str(err)}
        loss = F.mse_loss(out, y)
        loss.backward()
        inner.skip = None
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss))
        if scenario == "writes":
            if step == 0:
                saved = {k: v.detach().clone() for k, v in inner.state_dict().items()}
            between(inner, step, saved)
        if scenario == "eval":
            with torch.no_grad():
                model(x)
        if scenario == "raise":
            inner.fail_in = 2
            with pytest.raises(ValueError, match="half-way"):
                model(x)
            inner.fail_in = None
    inner.write_in_forward = False
    with torch.no_grad():  # gathers the last step's stale buckets
        model(batch(STEPS, rank)[0])
    compute = {name: p.detach().clone() for name, _g, _i, p in model.buffer.named_params()}
    return {"losses": losses, "params": model.buffer.views.full_parameters(), "compute": compute}


@functools.cache
def reference(scenario: str) -> dict:
    model = build()
    _configure(model, scenario)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses: list[float] = []
    saved = None
    for step in range(STEPS):
        per_rank = []
        for r in range(WORLD):
            x, y = batch(step, r)
            model.skip = 1 if scenario == "skip" and r == 0 and step % 2 == 1 else None
            per_rank.append(F.mse_loss(model(x), y))
        model.skip = None
        loss = sum(per_rank) / WORLD
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if scenario == "writes":
            if step == 0:
                saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
            between(model, step, saved)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def _both(strategy: int, scenario: str, precision: str) -> dict:
    return {overlap: _train(strategy, overlap, scenario, precision) for overlap in (True, False)}


SCENARIOS = (
    "writes",
    "eval",
    "raise",
    "order",
    "skip",
    "checkpoint",
    "checkpoint_reentrant",
    "write_in_forward",
)


def _scenarios(precision: str) -> tuple[str, ...]:
    # A write to a parameter inside the forward, installing inside the step, lands in
    # the bf16 compute weights only and is lost at the next install; left stale, it
    # lands in the main weights (a stale unit holds its DTensors) and is kept, as in fp32.
    return SCENARIOS if precision == "fp32" else SCENARIOS[:-1]


def _all_scenarios(strategy: int, precision: str) -> dict:
    return {s: _both(strategy, s, precision) for s in _scenarios(precision)}


@pytest.mark.parametrize("strategy", (1, 2), ids=lambda s: f"zero{s}")
@pytest.mark.parametrize("precision", ("fp32", "bf16"))
def test_weights_gathered_in_the_forward_train_as_an_install_inside_the_step(strategy, precision):
    """fp32: the main weights are the compute buffer's local shard; bf16: a main
    buffer of their own (float32 main weights, bfloat16 compute weights)."""
    results = run_distributed(_all_scenarios, WORLD, (strategy, precision), timeout=240)
    for scenario in _scenarios(precision):
        stale, inside = results[0][scenario][True], results[0][scenario][False]
        where = f"zero{strategy} {precision} {scenario}"
        assert stale["losses"] == inside["losses"], where
        for name, value in inside["params"].items():
            assert torch.equal(stale["params"][name], value), f"{where} {name}"
        for rank in range(WORLD):  # every rank computes with the updated whole weights
            for name, value in results[rank][scenario][True]["compute"].items():
                expected = stale["params"][name].to(value.dtype)
                assert torch.equal(value, expected), f"{where} rank {rank} compute {name}"
        if precision == "fp32":
            assert_same_training(stale, reference(scenario), where=where)


def test_reading_a_unit_before_its_gather_is_never_stale():
    """The root reads block 2's linear layer before block 2 runs (and so before its
    stale bucket is gathered): its parameters are the DTensors (the updated main
    weights), as a released unit's are under ZeRO-3, so torch raises; the weights of the
    step before are never used. Installing inside the step, the model trains."""
    results = run_distributed(_both, WORLD, (2, "peek", "fp32"), timeout=120)
    for result in results:
        stale, inside = result[True], result[False]
        assert "peek_error" not in inside and len(inside["losses"]) == STEPS
        assert "mixed torch.Tensor and DTensor" in stale["peek_error"]


def _wrapped(strategy: int, **options):
    """The test model under AdamW, wrapped per block."""
    module = build()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    return fully_shard(
        module, optimizer, fsdp_unit_modules=[Block], zero_dp_strategy=strategy, **options
    )


def _gathered_in_the_forward(strategy: int) -> dict:
    rank = dist.get_rank()
    model, optimizer = _wrapped(strategy, suggested_communication_unit_size=0)
    buffer, pipeline = model.buffer, model.all_gather_pipeline
    blocks = model.module.blocks
    gid = [model.hooks.swap.group_of_any(next(iter(b.parameters()))) for b in blocks]
    x, y = batch(0, rank)
    F.mse_loss(model(x), y).backward()
    stats = buffer.stats
    stats.reset()
    optimizer.step()
    after_step = stats.as_dict()["all_gather"]["calls"]
    status = pipeline.status
    stale_after_step = [status[g] is BucketStatus.STALE for g in range(len(status))]
    seen: list[list[BucketStatus]] = []
    handles = [  # after fsdp's pre-forward (prepended), before the block computes
        b.register_forward_pre_hook(lambda *_: seen.append([pipeline.status[g] for g in gid]))
        for b in blocks
    ]
    stats.reset()
    F.mse_loss(model(x), y).backward()
    in_forward = stats.as_dict()["all_gather"]["calls"]
    for h in handles:
        h.remove()
    return {
        "after_step": after_step,
        "in_forward": in_forward,
        "stale": stale_after_step,
        "expected_stale": sorted(model.hooks.swap.stale_after_step),
        "roots": list(buffer.root_groups),
        "seen": seen,
        "ready": all(s is BucketStatus.READY_TO_USE for s in pipeline.status),
    }


@pytest.mark.parametrize("strategy", (1, 2), ids=lambda s: f"zero{s}")
def test_stale_buckets_are_gathered_by_the_forward_with_prefetch(strategy):
    """The step issues no all-gather; every bucket it left STALE (the units' and the
    root buckets) is gathered once in the next forward, where each block finds its own
    bucket gathered and the next block's in flight (prefetched), the rest still stale."""
    for result in run_distributed(_gathered_in_the_forward, WORLD, (strategy,), timeout=120):
        stale = result["expected_stale"]
        assert set(result["roots"]) <= set(stale) and len(stale) == len(result["roots"]) + 4, result
        assert result["after_step"] == 0, result
        assert [g for g, s in enumerate(result["stale"]) if s] == stale, result
        assert result["in_forward"] == len(stale), result
        R, G, S = (
            BucketStatus.READY_TO_USE,
            BucketStatus.GATHER_IN_PROGRESS,
            BucketStatus.STALE,
        )
        assert result["seen"] == [[R, G, S, S], [R, R, G, S], [R, R, R, G], [R, R, R, R]], result
        assert result["ready"], result


def _broadcast_after_step(strategy: int, overlap: bool) -> dict:
    rank = dist.get_rank()
    model, optimizer = _wrapped(strategy, overlap_param_gather=overlap)
    x, y = batch(0, rank)
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    stepped = model.buffer.views.full_parameters()
    model.broadcast_params()  # reads the compute weights of every bucket
    return {"stepped": stepped, "broadcast": model.buffer.views.full_parameters()}


@pytest.mark.parametrize("strategy", (1, 2), ids=lambda s: f"zero{s}")
def test_a_broadcast_between_the_step_and_the_forward_keeps_the_step(strategy):
    """``broadcast_params`` re-derives the main weights from the compute weights it
    broadcasts: a stale bucket is installed first, so the step is not undone."""
    for overlap in (True, False):
        results = run_distributed(_broadcast_after_step, WORLD, (strategy, overlap), timeout=120)
        for result in results:
            for name, value in result["stepped"].items():
                assert torch.equal(result["broadcast"][name], value), (overlap, name)
