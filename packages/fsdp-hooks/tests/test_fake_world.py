"""The sharded path on one device: this process as rank 0 of a fake world of 4.

With one GPU the CUDA tests run at world 1, where nothing is sharded: the gather and
reduce streams (Note [streams and frees]), the reduce-scatters, the copy-out of the
gathered weights, the packing of gradients (``torch._chunk_cat``), the double buffer,
the installs after a step and HSDP never run there. torch's fake process group
(``torch.testing._internal.distributed.fake_pg``) completes every collective at once
without moving data, so that code runs here, in this process, on the test device (CPU,
or CUDA under ``--fsdp-device cuda``) for rank 0 of 4 (2 x 2 for HSDP): ZeRO-1/2/3 (with
the default coalescing, one bucket per unit, and the double buffer) and HSDP (outer
``no_shard`` and ``optim``), bf16 compute, both gradient stagings, three AdamW steps.

The values are meaningless (a fake all-gather repeats this rank's shard in every
slot; a fake reduce-scatter leaves its output as it was on torch 2.11 and copies this
rank's chunk on newer torch): this is a smoke test, not parity, and it cannot see a
race between streams. It checks that the buckets are sharded, that the collectives
were issued, that three steps run without error, that the parameters are this rank's
shards on the device, that the first loss is finite (its weights are this rank's real
shard, repeated), and on CUDA that the buffer communicates on its own streams and that
the device finishes the queued work (an asynchronous kernel error surfaces at
``torch.cuda.synchronize()``).

In-process: the default process group is global, so each case creates the fake world
and destroys it, and refuses to start when the process already has one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.nn import functional as F

from fsdp_buffers import MixedPrecisionPolicy
from fsdp_buffers.data_parallel_buffer import DoubleBufferAllocator
from fsdp_hooks import fully_shard
from fsdp_mesh import build_device_mesh
from fsdp_mesh.testing import harness_device_type
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

# Runs on CUDA under --fsdp-device cuda (root conftest.py), in this process, on its GPU.
pytestmark = pytest.mark.cuda

CFG = GPTConfig(vocab_size=48, max_seq_len=8, dim=16, n_heads=2, n_layers=3)
WORLD = 4
STEPS = 3
ROWS = 2


@dataclass(frozen=True)
class Layout:
    strategy: int  # zero_dp_strategy
    outer: str | None = None  # outer_dp_sharding_strategy on a 2 x 2 mesh; None: flat 4
    options: tuple[tuple[str, object], ...] = ()  # more fully_shard options


# One bucket per unit (no coalescing): the next unit's gather is prefetched while one
# computes, so the gather stream runs ahead of compute.
PER_UNIT = (("suggested_communication_unit_size", 0),)
LAYOUTS = {
    "zero1": Layout(1),
    "zero2": Layout(2),
    "zero3": Layout(3),  # the default coalescing: consecutive blocks gathered together
    "zero3_per_unit": Layout(3, options=PER_UNIT),
    "zero3_double_buffer": Layout(3, options=(*PER_UNIT, ("fsdp_double_buffer", True))),
    "hsdp_no_shard": Layout(3, "no_shard"),
    "hsdp_optim": Layout(3, "optim"),
}


def _device() -> torch.device:
    # The fake backend is neither gloo nor NCCL, so harness_device() would say CPU.
    if harness_device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@pytest.fixture
def fake_world() -> Iterator[None]:
    if dist.is_initialized():
        raise RuntimeError(
            "this process already has a default process group; the fake world needs its "
            "own (run this test in a process without one)"
        )
    # Importing the module registers the "fake" backend (for cpu and cuda).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _wrap(name: str, staging: str, device: torch.device):
    layout = LAYOUTS[name]
    options: dict = dict(layout.options)
    if layout.outer is None:
        mesh = build_device_mesh(dp_shard=WORLD, device_type=device.type).device_mesh
    else:
        mesh = build_device_mesh(dp_outer=2, dp_shard=2, device_type=device.type).device_mesh
        options.update(dp_outer_dim="dp_outer", outer_dp_sharding_strategy=layout.outer)
    torch.manual_seed(0)
    module = GPT(CFG).to(torch.bfloat16)  # bf16 compute, fp32 main weights and grads
    return fully_shard(
        module,
        torch.optim.AdamW(module.parameters(), lr=1e-3),
        device_mesh=mesh,
        dp_shard_dim="dp_shard",
        fsdp_unit_modules=[Block],
        zero_dp_strategy=layout.strategy,
        mixed_precision_policy=MixedPrecisionPolicy(),
        grad_staging=staging,
        **options,
    )


def _check_buckets_sharded(model, name: str) -> None:
    strategy, outer = LAYOUTS[name].strategy, LAYOUTS[name].outer
    buckets = list(zip(model.buffer.buckets, model.buffer.groups, strict=True))
    assert buckets and all(g.requires_grad for _, g in buckets)
    options = dict(LAYOUTS[name].options)
    if options.get("suggested_communication_unit_size") == 0:
        assert len(buckets) == CFG.n_layers + 1, name  # one per block, one for the root
    else:  # the default coalescing: consecutive blocks share a bucket
        assert any(len(g.coalesced_unit_ids) > 1 for _, g in buckets), name
    if options.get("fsdp_double_buffer"):  # the blocks' gathered weights take turns
        slotted = [isinstance(b.model.allocator, DoubleBufferAllocator) for b, _ in buckets]
        assert sum(slotted) == CFG.n_layers, (name, slotted)
    for bucket, group in buckets:
        where = f"{name}: bucket {bucket.gid} ({bucket.sharding})"
        assert bucket.sharding.main_weights, where
        assert bucket.sharding.grads == (strategy >= 2), where
        assert bucket.sharding.model_weights == (strategy == 3), where
        full = bucket.layout.total_numel
        assert bucket.main_weights.numel < full, where
        assert (group.main_grad_buffer.numel < full) == (strategy >= 2), where
        assert (bucket.model.numel < full) == (strategy == 3), where
        # Fully-sharded HSDP: the main weights are a part of the shard group's shard.
        assert bucket.outer_sharded == (outer == "optim"), where
        if outer == "optim":
            assert bucket.main_weights.numel < bucket.model.numel, where


def _check_local_shards(model, name: str, device: torch.device) -> None:
    # HSDP replicates over the outer dim, unless the main weights are sharded there too.
    mesh_size = 2 if LAYOUTS[name].outer == "no_shard" else WORLD
    for pname, p in model.module.named_parameters():
        where = f"{name}: {pname}"
        assert isinstance(p, DTensor), where
        assert p.device_mesh.size() == mesh_size, (where, p.device_mesh)
        assert p.placements == (Shard(0),), (where, p.placements)
        local = p.to_local()
        assert local.device == device, (where, local.device)
        # Rank 0's piece of torch.chunk along dim 0.
        expected = (min(p.shape[0], math.ceil(p.shape[0] / mesh_size)), *p.shape[1:])
        assert tuple(local.shape) == expected, (where, tuple(local.shape), expected)
        assert local.numel() < p.numel(), where


@pytest.mark.parametrize("staging", ["autograd", "main_grad"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sharded_training_steps_in_a_fake_world(fake_world, name, staging):
    device = _device()
    model, opt = _wrap(name, staging, device)
    assert model.buffer.comm.has_streams == (device.type == "cuda")
    _check_buckets_sharded(model, name)
    model.comm_stats(reset=True)
    for step in range(STEPS):
        x, y = token_batch(step, ROWS, CFG.max_seq_len, CFG.vocab_size, device=device)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        if step == 0:
            assert torch.isfinite(loss).item(), f"{name}/{staging}: first loss {loss.item()}"
        loss.backward()
        opt.step()
        opt.zero_grad()
    # The sharded path ran: the gradients were reduce-scattered into the shards and the
    # weights gathered from them (ZeRO-1/2: the updated shards, in the next forward).
    calls = {kind: c["calls"] for kind, c in model.comm_stats().items()}
    assert calls["reduce_scatter"] >= STEPS, (name, calls)
    assert calls["all_gather"] > 0, (name, calls)
    if LAYOUTS[name].outer == "no_shard":  # the outer reduction across the replicas
        assert calls["all_reduce"] >= STEPS, (name, calls)
    _check_local_shards(model, name, device)
    if device.type == "cuda":
        torch.cuda.synchronize()  # an asynchronous kernel error surfaces here
