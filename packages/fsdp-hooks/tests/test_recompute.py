"""Activation recompute (``torch.utils.checkpoint``) under ZeRO-3.

A unit's forward that runs again inside backward is not a new forward (hooks.py's note):
its pre-forward finds the buckets the unit's pre-backward gathered (or gathers them, when
the unit's forward ran under ``no_grad`` as reentrant checkpointing does, so no
pre-backward was registered), and its post-forward keeps them for the backward that
follows. So with recompute:

- losses and gradients equal training without recompute in one process;
- each step issues exactly as many all-gathers as without recompute;
- inside a recompute the model and the unit are in PRE_BACKWARD (it is part of the
  unit's backward), and after each step the model and every unit are IDLE.

Four ways to recompute, each with ``use_reentrant`` True and False:
``unit``: the parent calls ``checkpoint(block, x)``, so the FSDP unit itself is the
recomputed module (its hooks run again inside backward); ``inner``: the unit's own
forward checkpoints its body (the unit's hooks run once, the body twice).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from fsdp_hooks import TrainingState, fully_shard
from fsdp_hooks.runtime.backward import in_backward
from fsdp_mesh.testing import (
    assert_losses_close,
    assert_tensors_close,
    gather_rows,
    run_distributed,
)
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

WORLD = 2
STEPS = 3
GLOBAL_BATCH = 4
SEQ_LEN = 8
CFG = GPTConfig(vocab_size=64, max_seq_len=SEQ_LEN, dim=32, n_heads=4, n_layers=2)
LR = 1e-2
# eps: see test_parity.py (the attention key bias has an exactly-zero gradient, whose
# rounding noise Adam with eps=1e-8 would turn into lr-sized, order-dependent updates).
ADAM_EPS = 1e-3
MODES = (
    "none",
    "unit_reentrant",
    "unit_non_reentrant",
    "inner_reentrant",
    "inner_non_reentrant",
)


class CheckpointingGPT(GPT):
    """GPT whose forward runs each Block (the FSDP unit) under ``checkpoint``."""

    use_reentrant = True

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(self.ln_f(x))


class CheckpointedBlock(Block):
    """A Block (the FSDP unit) whose forward checkpoints its own body."""

    use_reentrant = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, use_reentrant=self.use_reentrant)


def build(mode: str) -> tuple[GPT, type[torch.nn.Module]]:
    torch.manual_seed(0)
    if mode == "none":
        return GPT(CFG), Block
    kind, reentrant = mode.split("_", 1)
    use_reentrant = reentrant == "reentrant"
    model = GPT(CFG)
    if kind == "unit":
        model.__class__ = CheckpointingGPT
        model.use_reentrant = use_reentrant
        return model, Block
    for block in model.blocks:
        block.__class__ = CheckpointedBlock
        block.use_reentrant = use_reentrant
    return model, CheckpointedBlock


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(step, GLOBAL_BATCH, SEQ_LEN, CFG.vocab_size, seed=2)


def loss_fn(model, x, y) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _full(model, name: str, local: torch.Tensor, placement) -> torch.Tensor:
    """A whole tensor from the ranks' uneven dim-0 row shards."""
    if placement.is_replicate():
        return local.clone()
    return gather_rows(local, model.buffer.views.local_rows(name))


def _probe_bodies(module: GPT, wrapped: list) -> tuple[list[int], list]:
    """How often each block's body runs (twice per step when it is recomputed), and
    the (model, unit) states each recompute sees; ``wrapped`` will hold the model."""
    body_runs = [0] * len(module.blocks)
    recompute_states: list = []

    def on_body(i: int) -> None:
        body_runs[i] += 1
        if in_backward():
            fsdp = wrapped[0]
            recompute_states.append((fsdp.training_state, fsdp.unit_training_state(i)))

    for i, block in enumerate(module.blocks):
        block.attn.register_forward_pre_hook(lambda *_a, i=i: on_body(i))
    return body_runs, recompute_states


def _train(modes: tuple[str, ...]) -> dict[str, dict]:
    rank = dist.get_rank()
    per_rank = GLOBAL_BATCH // WORLD
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    out = {}
    for mode in modes:
        module, unit_class = build(mode)
        wrapped: list = []
        body_runs, recompute_states = _probe_bodies(module, wrapped)
        optimizer = torch.optim.AdamW(module.parameters(), lr=LR, eps=ADAM_EPS)
        model, optimizer = fully_shard(
            module,
            optimizer,
            fsdp_unit_modules=[unit_class],
            zero_dp_strategy=3,
            suggested_communication_unit_size=0,  # gathers counted per unit
        )
        wrapped.append(model)
        pipeline = model.all_gather_pipeline
        groups = model.buffer.groups
        record: dict = {
            "sharded_unit_buckets": sum(
                1
                for gid, g in enumerate(groups)
                if g.fsdp_unit_id is not None and pipeline.is_distributed(gid)
            ),
            "sharded_other_buckets": sum(
                1
                for gid, g in enumerate(groups)
                if g.fsdp_unit_id is None and pipeline.is_distributed(gid)
            ),
            "units": len(model.hooks.units),
            "losses": [],
            "grads": [],
            "gathers": [],
            "body_runs": [],
            "states": [],
            "recompute_states": recompute_states,
        }
        model.comm_stats(reset=True)
        for step in range(STEPS):
            body_runs[:] = [0] * len(body_runs)
            x, y = batch(step)
            loss = loss_fn(model, x[mine], y[mine])
            forward_gathers = model.comm_stats(reset=True)["all_gather"]["calls"]
            loss.backward()
            backward_gathers = model.comm_stats(reset=True)["all_gather"]["calls"]
            grads = {}
            for name, p in model.named_parameters():
                name = name.removeprefix("module.")
                grads[name] = _full(model, name, p.grad.to_local(), p.grad.placements[0])
            optimizer.step()
            optimizer.zero_grad()
            step_gathers = model.comm_stats(reset=True)["all_gather"]["calls"]
            record["states"].append(
                (
                    model.training_state,
                    [model.unit_training_state(i) for i in range(record["units"])],
                )
            )
            total = loss.detach().clone()
            dist.all_reduce(total)
            record["losses"].append(total.item() / WORLD)
            record["grads"].append(grads)
            record["gathers"].append((forward_gathers, backward_gathers, step_gathers))
            record["body_runs"].append(list(body_runs))
        record["params"] = {
            name.removeprefix("module."): _full(
                model, name.removeprefix("module."), p.to_local(), p.placements[0]
            )
            for name, p in model.named_parameters()
        }
        out[mode] = record
    return out if rank == 0 else {}


@functools.cache
def reference() -> dict:
    """The same model without recompute, in one process, on the global batch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks
    try:
        model, _ = build("none")
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
        losses, grads = [], []
        for step in range(STEPS):
            x, y = batch(step)
            loss = loss_fn(model, x, y)
            loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        return {"losses": losses, "grads": grads, "params": params}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained() -> dict[str, dict]:
    return run_distributed(_train, WORLD, args=(MODES,), timeout=240)[0]


def test_layout_is_what_the_gather_formula_assumes(trained):
    for mode, record in trained.items():
        # Two Blocks, one bucket each; embeddings, final norm and the tied head share one.
        assert record["units"] == CFG.n_layers, mode
        assert record["sharded_unit_buckets"] == CFG.n_layers, mode
        assert record["sharded_other_buckets"] == 1, mode


@pytest.mark.parametrize("mode", MODES)
def test_recompute_matches_reference(trained, mode):
    ref = reference()
    record = trained[mode]
    recomputed = mode != "none"
    # The recompute really happened: each block's body ran twice per step (once here).
    assert record["body_runs"] == [[2 if recomputed else 1] * CFG.n_layers] * STEPS, mode
    assert_losses_close(record["losses"], ref["losses"], where=mode)
    for step in range(STEPS):
        assert_tensors_close(
            record["grads"][step], ref["grads"][step], atol=1e-7, where=f"{mode} step {step} grad"
        )
    assert_tensors_close(record["params"], ref["params"], where=mode)


@pytest.mark.parametrize("mode", MODES)
def test_recompute_gathers_each_unit_once_for_recompute_and_backward(trained, mode):
    record = trained[mode]
    units, others = record["sharded_unit_buckets"], record["sharded_other_buckets"]
    # Per step, under ZeRO-3: every sharded bucket of a unit is gathered once for
    # forward and once for backward, where the recompute shares the backward's gather;
    # buckets outside every unit are gathered once, at the root's pre-forward, and stay
    # gathered until the end of backward; optimizer.step() gathers nothing (the updated
    # weights are copied into the local shards). So: 2 x 2 + 1 = 5 for this model.
    forward = units + others
    backward = units
    assert forward + backward == 2 * units + others == 5
    for step, gathers in enumerate(record["gathers"]):
        assert gathers == (forward, backward, 0), (mode, step, gathers)
    assert record["gathers"] == trained["none"]["gathers"]


@pytest.mark.parametrize("mode", MODES)
def test_idle_after_every_step(trained, mode):
    idle = TrainingState.IDLE
    for root, units in trained[mode]["states"]:
        assert root is idle
        assert units == [idle] * CFG.n_layers


@pytest.mark.parametrize("mode", [m for m in MODES if m != "none"])
def test_recompute_runs_in_pre_backward(trained, mode):
    # TrainingState: a unit is PRE_BACKWARD from the first gradient reaching its outputs
    # until the gradients of its inputs are computed, and its recompute runs in between.
    # (With the unit checkpointed reentrantly its forward ran under no_grad, so no
    # pre-backward hook fired: the recompute's pre-forward must say so itself.)
    states = trained[mode]["recompute_states"]
    assert len(states) == STEPS * CFG.n_layers, mode
    pre = TrainingState.PRE_BACKWARD
    assert set(states) == {(pre, pre)}, (mode, states)
