"""Hybrid sharding (HSDP) on a 2 x 2 mesh (dp_outer, dp_shard), CPU/gloo, world size 4.

* Parity: HSDP (outer replicate) and fully-sharded HSDP (``outer_dp_sharding_strategy=
  "optim"``), K microbatches per step, AdamW with ``clip_grad_norm_``, reproduce the
  losses, gradient norms and final parameters of one process training on the whole
  global batch (fp32, 1e-5 relative), whether the outer reduction runs on every
  microbatch or once per step; also through ``MegatronFSDP`` with an index that has
  ``dp_outer_dim``, and for the inner strategies 0-2.
* Counted collectives: deferred, the outer all-reduce (HSDP) or reduce-scatter
  (fully-sharded) runs once per trainable bucket per step, not once per microbatch.
* Checkpoints: saved under fully-sharded HSDP, loaded under plain FSDP at world size 2,
  saved again and loaded back under HSDP and fully-sharded HSDP; the losses are those
  of one uninterrupted run.
* Bad input: a clear error on every rank.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from fsdp_buffers import MixedPrecisionPolicy
from fsdp_hooks import DistributedDataParallelConfig, MegatronFSDP, fully_shard
from fsdp_mesh import FSDPDistributedIndex, build_device_mesh
from fsdp_mesh.testing import mean_over_ranks, run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

CFG = GPTConfig(vocab_size=48, max_seq_len=8, dim=16, n_heads=2, n_layers=2)
WORLD = 4
K = 3  # microbatches per step
M = 2  # rows per microbatch per rank
STEPS = 3
LR = 1e-2
MAX_NORM = 1.0
# See test_parity.py: GPT's qkv key bias gets a rounding-noise gradient; eps bounds
# Adam's gain on it so that parity is about fsdp, not about summation order.
EPS = 1e-3


def _global_batch(step):
    return token_batch(step, WORLD * K * M, CFG.max_seq_len, CFG.vocab_size)


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=0.1)


def _gpt():
    """The tiny GPT plus an unused 0-d parameter: a replicated (``fsdp_no_shard``)
    bucket, whose DTensor must share the optimizer mesh of the sharded ones."""
    model = GPT(CFG)
    model.scale = nn.Parameter(torch.tensor(1.0))
    return model


def _reference():
    torch.manual_seed(0)
    model = _gpt()
    opt = _optimizer(model.parameters())
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _global_batch(step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        # model.scale gets no gradient: .grad None here and in fsdp, so AdamW skips it.
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- ranks ---------------------------------------------------------------------------


def _mesh():
    return build_device_mesh(dp_outer=2, dp_shard=2).device_mesh


def _build(scenario):
    """(model, optimizer, outer kind, sync each microbatch) for a scenario name."""
    torch.manual_seed(0)
    module = _gpt()
    extra = {}
    if "bf16" in scenario:  # bf16 compute, fp32 main weights and grads
        module = module.to(torch.bfloat16)
        extra["mixed_precision_policy"] = MixedPrecisionPolicy()
    if scenario.startswith("flat"):  # plain FSDP over the 4 ranks, to compare with
        model, opt = fully_shard(
            module, _optimizer(module.parameters()), fsdp_unit_modules=[Block], **extra
        )
        return model, opt, "none", True
    fully = scenario.startswith("full")
    sync_each = scenario.endswith("sync_each")
    if scenario.startswith("megatron"):
        index = FSDPDistributedIndex(_mesh(), dp_shard_dim="dp_shard", dp_outer_dim="dp_outer")
        model = MegatronFSDP(
            module,
            index,
            ddp_config=DistributedDataParallelConfig(data_parallel_sharding_strategy=2),
            fsdp_unit_modules=[Block],
        )
        from fsdp_hooks import fully_shard_optimizer

        return model, fully_shard_optimizer(_optimizer(model.parameters())), "ar", False
    strategy = int(scenario.split("_z")[1][0]) if "_z" in scenario else 3
    model, opt = fully_shard(
        module,
        _optimizer(module.parameters()),
        device_mesh=_mesh(),
        dp_shard_dim="dp_shard",
        dp_outer_dim="dp_outer",
        fsdp_unit_modules=[Block],
        zero_dp_strategy=strategy,
        outer_dp_sharding_strategy="optim" if fully else "no_shard",
        sync_model_each_microbatch=sync_each,
        **extra,
    )
    return model, opt, ("rs" if fully else "ar"), sync_each


def _train_scenario(scenario):
    rank = dist.get_rank()
    model, opt, outer_kind, sync_each = _build(scenario)
    buf = model.buffer
    trainable = [g for g, grp in enumerate(buf.groups) if grp.requires_grad]
    nbs = sum(1 for g in trainable if buf.buckets[g].sharding.grads)  # reduce-scattered inside
    nbr = len(trainable) - nbs  # replicated grads (the 0-d parameter): all-reduced
    strategy = model.strategy
    losses, norms, counts = [], [], []
    for step in range(STEPS):
        x, y = _global_batch(step)
        model.comm_stats(reset=True)
        total = torch.zeros(())
        for j in range(K):
            start = rank * K * M + j * M
            xb, yb = x[start : start + M], y[start : start + M]
            loss = F.cross_entropy(model(xb).flatten(0, 1), yb.flatten()) / K
            loss.backward()
            total += loss.detach().float()
        # Deferred outer reduction: gradients are complete only after finish_grad_sync
        # (optimizer.step calls it too; a second call does nothing).
        model.finish_grad_sync()
        before_step = model.comm_stats(reset=True)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        after_step = model.comm_stats(reset=True)
        opt.zero_grad()
        losses.append(mean_over_ranks(total))
        counts.append((before_step, after_step))
    if strategy >= 2 and outer_kind != "none":
        # Deferred, the outer reduction runs once per step; with sync_each, once per
        # microbatch (and so does the inner one of replicated gradients).
        m = K if sync_each else 1
        for before, after in counts:
            # Inner reductions: a sharded-grad bucket's once per microbatch, a
            # replicated one's m times; outer: m times per bucket per step.
            rs_inner = K * nbs
            if outer_kind == "ar":
                assert before["reduce_scatter"]["calls"] == rs_inner, before
                assert before["all_reduce"]["calls"] == m * nbr + m * (nbs + nbr), before
            else:
                assert before["reduce_scatter"]["calls"] == rs_inner + m * nbs, before
                assert before["all_reduce"]["calls"] == m * nbr + m * nbr, before
                # The outer gather of the updated weights: once per bucket, in step().
                assert after["all_gather"]["calls"] == nbs, after
            assert after["reduce_scatter"]["calls"] == after["all_reduce"]["calls"] == 0
    elif outer_kind == "ar":
        # Replicated gradients (ZeRO-0/1): deferred, nothing is reduced until
        # finish_grad_sync, then each bucket once inside (reduce-scatter where main
        # weights are sharded, else all-reduce) and once across (all-reduce); with
        # sync_each, K times.
        assert nbs == 0
        m = K if sync_each else 1
        n_rs = sum(1 for g in trainable if buf.buckets[g].sharding.main_weights)
        # Stale buckets are gathered in the next forward (Note [stale buckets]).
        deferred = len(model.hooks.swap.stale_after_step)
        assert deferred > 0 or strategy == 0
        for i, (before, after) in enumerate(counts):
            assert before["reduce_scatter"]["calls"] == m * n_rs, before
            assert before["all_reduce"]["calls"] == m * (nbr - n_rs) + m * nbr, before
            # ZeRO-1: the updated weight shards are gathered once per bucket: in step(),
            # or in the next forward.
            assert after["all_gather"]["calls"] == n_rs - deferred, after
            assert before["all_gather"]["calls"] == (deferred if i else 0), before
            assert after["reduce_scatter"]["calls"] == after["all_reduce"]["calls"] == 0
        assert (n_rs > 0) == (strategy == 1)
    for name, p in model.module.named_parameters():
        assert isinstance(p, DTensor), name
        if outer_kind == "rs":
            assert p.device_mesh.size() == WORLD, (name, p.device_mesh)
    if outer_kind == "rs":  # main weights: a half of each shard-group shard
        assert sum(b.outer_sharded for b in buf.buckets) == nbs
        for gid, group in enumerate(model.buffer.groups):
            if buf.buckets[gid].outer_sharded:
                main = model.buffer.buckets[gid].main_weights
                assert 2 * main.data.numel() == group.model_weight_buffer.data.numel()
                # Their gradients: the group's hsdp_gbuf, a half of the main-grad shard.
                assert buf.buckets[gid].grads.optimizer_grads is group.hsdp_gbuf
                assert 2 * group.hsdp_gbuf.data.numel() == group.main_grad_buffer.data.numel()
            else:
                assert group.hsdp_gbuf is None
    params = model.buffer.views.full_parameters()
    return (losses, norms, params) if rank == 0 else None


def _broadcast_params():
    """After ``broadcast_params`` every outer replica holds outer rank 0's weights."""
    model, _opt, _kind, _sync = _build("hsdp_deferred")
    index = model.dist_index
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(float(index.outer_rank))  # replicas now differ
    model.broadcast_params()
    torch.manual_seed(0)
    ref = dict(_gpt().named_parameters())
    for name, *_ in model.buffer.named_params():
        torch.testing.assert_close(model.buffer.views.full_parameter(name), ref[name].detach())


def _world4_job(scenarios, ckpt_dir):
    """Everything one 4-rank run checks (one spawn instead of several)."""
    out = {"scenarios": {s: _train_scenario(s) for s in scenarios}}
    out["bf16"] = {s: _train_scenario(s) for s in BF16_SCENARIOS}
    _broadcast_params()
    out["bad"] = _bad_inputs()
    out["ckpt"] = _ckpt_phase([("optim", None, ckpt_dir, 0, 2)])
    return out


SCENARIOS = (
    "hsdp_sync_each",
    "hsdp_deferred",
    "full_sync_each",
    "full_deferred",
    "megatron_hsdp_z2",
    "hsdp_z0_deferred",
    "hsdp_z1_sync_each",
    "hsdp_z2_deferred",
)
# Mixed precision: hybrid runs must match plain FSDP over the same 4 ranks.
BF16_SCENARIOS = ("flat_bf16", "hsdp_bf16_deferred", "full_bf16_deferred", "full_bf16_sync_each")


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    ckpt_dir = str(tmp_path_factory.mktemp("hybrid_ckpt") / "a")
    return ckpt_dir, run_distributed(_world4_job, WORLD, args=(SCENARIOS, ckpt_dir), timeout=150)


def test_hsdp_parity_and_outer_reduction_count(world4):
    ref_losses, ref_norms, ref_params = _reference()
    assert max(ref_norms) > MAX_NORM  # clipping is exercised
    results = world4[1][0]["scenarios"]
    for scenario, (losses, norms, params) in results.items():
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0, msg=scenario)
        torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0, msg=scenario)
        assert set(params) == set(ref_params), scenario
        for name, ref in ref_params.items():
            torch.testing.assert_close(
                params[name],
                ref,
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, n=name, s=scenario: f"{s}: {n}: {m}",
            )


def test_hsdp_bf16_matches_flat_fsdp(world4):
    results = world4[1][0]["bf16"]
    flat_losses, flat_norms, flat_params = results["flat_bf16"]
    for scenario in BF16_SCENARIOS[1:]:
        losses, norms, params = results[scenario]
        torch.testing.assert_close(losses, flat_losses, rtol=1e-4, atol=0, msg=scenario)
        torch.testing.assert_close(norms, flat_norms, rtol=1e-4, atol=0, msg=scenario)
        for name, ref in flat_params.items():
            assert params[name].dtype == torch.float32, (scenario, name)
            torch.testing.assert_close(
                params[name], ref, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
            )


# ---- checkpoints ---------------------------------------------------------------------


def _ckpt_train(model, opt, start, stop):
    rank, world = dist.get_rank(), dist.get_world_size()
    b = WORLD * M // world
    losses = []
    for step in range(start, stop):
        x, y = token_batch(step, WORLD * M, CFG.max_seq_len, CFG.vocab_size)
        x, y = x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        model.finish_grad_sync()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
    return losses


def _wrap(outer, seed):
    torch.manual_seed(seed)
    module = GPT(CFG)
    kwargs = {"fsdp_unit_modules": [Block], "zero_dp_strategy": 3}
    if outer is not None:
        kwargs.update(
            device_mesh=_mesh(),
            dp_shard_dim="dp_shard",
            dp_outer_dim="dp_outer",
            outer_dp_sharding_strategy=outer,
        )
    return fully_shard(module, _optimizer(module.parameters()), **kwargs)


def _ckpt_phase(phases):
    from fsdp_ckpt import load_checkpoint, save_checkpoint

    losses = []
    for outer, load_from, save_to, start, stop in phases:
        model, opt = _wrap(outer, 0 if load_from is None else 1234)
        if load_from is not None:
            assert load_checkpoint(load_from, model, opt) == {"step": start}
        losses += _ckpt_train(model, opt, start, stop)
        if save_to is not None:
            save_checkpoint(save_to, model, opt, extra={"step": stop})
    return losses


def _ckpt_reference(steps):
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = _optimizer(model.parameters())
    losses = []
    for step in range(steps):
        x, y = token_batch(step, WORLD * M, CFG.max_seq_len, CFG.vocab_size)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_checkpoint_hsdp_to_fsdp_and_back(world4):
    """Saved under fully-sharded HSDP (in the 4-rank run), loaded under plain FSDP at
    world size 2, saved, loaded under HSDP, saved, loaded under fully-sharded HSDP."""
    a, results = world4
    first = results[0]["ckpt"]
    with tempfile.TemporaryDirectory() as tmp:
        b, c = (os.path.join(tmp, d) for d in "bc")
        second = run_distributed(_ckpt_phase, 2, args=([(None, a, b, 2, 3)],))[0]
        third = run_distributed(
            _ckpt_phase, 4, args=([("no_shard", b, c, 3, 4), ("optim", c, None, 4, 5)],)
        )[0]
    torch.testing.assert_close(first + second + third, _ckpt_reference(5), rtol=1e-5, atol=0)


# ---- bad input -----------------------------------------------------------------------


def _error_of(fn):
    try:
        fn()
    except (ValueError, NotImplementedError) as err:
        return type(err).__name__, str(err)
    return None


def _bad_inputs():
    mesh = _mesh()
    out = {}

    def wrap(**kwargs):
        torch.manual_seed(0)
        module = GPT(CFG)
        fully_shard(module, _optimizer(module.parameters()), **kwargs)

    out["world"] = _error_of(lambda: build_device_mesh(dp_outer=2, dp_shard=3))
    small = DeviceMesh("cpu", torch.tensor([[0, 1]]), mesh_dim_names=("dp_outer", "dp_shard"))
    out["mesh_not_world"] = _error_of(
        lambda: wrap(device_mesh=small, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer")
    )
    out["outer_without_dim"] = _error_of(
        lambda: wrap(device_mesh=mesh, dp_shard_dim="dp_shard", outer_dp_sharding_strategy="optim")
    )
    out["outer_needs_z3"] = _error_of(
        lambda: wrap(
            device_mesh=mesh,
            dp_shard_dim="dp_shard",
            dp_outer_dim="dp_outer",
            zero_dp_strategy=2,
            outer_dp_sharding_strategy="optim",
        )
    )
    out["outer_bad"] = _error_of(
        lambda: wrap(
            device_mesh=mesh,
            dp_shard_dim="dp_shard",
            dp_outer_dim="dp_outer",
            outer_dp_sharding_strategy="optim_grads",
        )
    )
    index = FSDPDistributedIndex(
        mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", hsdp_outer_dp_shard=True
    )
    out["index_mismatch"] = _error_of(
        lambda: MegatronFSDP(
            GPT(CFG),
            index,
            ddp_config=DistributedDataParallelConfig(data_parallel_sharding_strategy=3),
        )
    )
    # Tensor parallelism with hybrid sharding: test_mesh_combinations.py. A size-1 tp dim (what build_device_mesh always has) is fine.
    wrap(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", tp_dim="tp")
    return out


def test_bad_input_errors_on_every_rank(world4):
    results = [r["bad"] for r in world4[1]]
    expected = {
        "world": ("ValueError", "multiply to the world size"),
        "mesh_not_world": ("ValueError", "the mesh must cover every rank"),
        "outer_without_dim": ("ValueError", "no outer dim was given"),
        "outer_needs_z3": ("ValueError", "requires data_parallel_sharding_strategy"),
        "outer_bad": ("ValueError", "is not supported"),
        "index_mismatch": ("ValueError", "hsdp_outer_dp_shard"),
    }
    for rank, out in enumerate(results):
        for key, (kind, text) in expected.items():
            assert out[key] is not None, f"rank {rank}: {key} raised nothing"
            assert out[key][0] == kind and text in out[key][1], (rank, key, out[key])
