"""Memory held per rank on 4 ranks (gloo): under ZeRO-3 with every bucket released a rank
holds its 1/N shard of the model state plus its share of the layouts' padding, counted
both by ``persistent_bytes()`` and directly from the storages every tensor points to;
gathering a bucket adds exactly its unsharded bytes, releasing it takes them back, and a
whole training step leaves nothing behind. Strategy 0 holds everything whole."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_mesh
from fsdp_buffers import AllGatherPipeline, GradReducePipeline, ParamAndGradBuffer
from fsdp_mesh.testing import harness_device, held_storage_bytes, run_distributed

# Runs on CUDA + NCCL under --fsdp-device cuda (root conftest.py).
pytestmark = pytest.mark.cuda

WORLD = 4


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int = 48) -> None:
        super().__init__()
        self.inp = nn.Linear(20, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(4)])
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _held_bytes(model, buf):
    """Bytes of the memory held by every live storage reachable from the buffers, the
    compute parameters, their main grads and the optimizer's DTensors (each byte once:
    the DTensors' local tensors alias the buffers)."""
    tensors = []
    for group in buf.groups:
        for b in (group.model_weight_buffer, group.main_weight_buffer, group.main_grad_buffer):
            if b is not None:
                tensors += [b.data, b.unsharded_tensor()]
    for p in model.parameters():
        tensors.append(p)
        if getattr(p, "main_grad", None) is not None:
            tensors.append(p.main_grad)
    for _name, dparam in buf.views.optimizer_named_parameters():
        tensors += [dparam.to_local(), dparam.grad.to_local()]
    return held_storage_bytes(tensors)


def _bytes_per_element(buf, gid):
    group = buf.groups[gid]
    bufs = (group.model_weight_buffer, group.main_weight_buffer, group.main_grad_buffer)
    return sum(b.element_size for b in bufs if b is not None)


def _memory(dtype):
    rank = dist.get_rank()
    mesh = init_device_mesh(harness_device().type, (WORLD,), mesh_dim_names=("dp",))
    index = fsdp_mesh.FSDPDistributedIndex(mesh, dp_shard_dim="dp")
    held = {}
    for strategy in (0, 1, 2, 3):
        torch.manual_seed(0)
        # On the rank's device: the buffers are allocated where the parameters are.
        model = Net().to(device=harness_device(), dtype=dtype)
        numel = sum(p.numel() for p in model.parameters())
        buf = ParamAndGradBuffer(model, index, strategy=strategy, fsdp_unit_modules=[Block])
        ag, gr = AllGatherPipeline(buf), GradReducePipeline(buf)
        gr.register_grad_hooks()
        layouts = [b.layout for b in buf.buckets]
        assert all(lay.shard_count == WORLD for lay in layouts)
        # Model state per element: compute weights, fp32 main weights if separate, grads.
        per_elem = [_bytes_per_element(buf, g) for g in range(buf.num_buckets)]
        assert per_elem == [4 + 4 if dtype == torch.float32 else 2 + 4 + 4] * buf.num_buckets
        full_bytes = numel * per_elem[0]
        padding_bytes = sum(lay.padding_numel * e for lay, e in zip(layouts, per_elem, strict=True))
        shard_bytes = sum(lay.shard_numel * e for lay, e in zip(layouts, per_elem, strict=True))
        assert WORLD * shard_bytes == full_bytes + padding_bytes

        persistent = buf.persistent_bytes()
        assert _held_bytes(model, buf) == persistent
        held[strategy] = persistent
        if strategy == 3:
            assert persistent == shard_bytes
            assert persistent <= (full_bytes + padding_bytes) / WORLD
            # Padding is a small part of it for this model.
            assert padding_bytes < 0.1 * full_bytes
            # Gathering one bucket adds exactly its unsharded bytes; release takes them back.
            for gid in range(buf.num_buckets):
                ag.all_gather_params([gid], prefetch=False)
                assert _held_bytes(model, buf) == persistent + buf.buckets[gid].unsharded_bytes
                assert buf.buckets[gid].unsharded_bytes == layouts[gid].total_numel * dtype.itemsize
                ag.release_bucket(gid)
                assert _held_bytes(model, buf) == persistent
            ag.all_gather_params([1, 2], prefetch=False)
            both = buf.buckets[1].unsharded_bytes + buf.buckets[2].unsharded_bytes
            assert _held_bytes(model, buf) == persistent + both
            ag.reset()
            assert _held_bytes(model, buf) == persistent
        # A whole step (gather, backward, reduce, optimizer, install) leaks nothing:
        # gradient staging buckets and gathered weights are all given back.
        opt = torch.optim.SGD([p for _, p in buf.views.optimizer_named_parameters()], lr=0.1)
        ag.all_gather_params(range(buf.num_buckets))
        x = torch.randn(3, 20, generator=torch.Generator().manual_seed(rank)).to(harness_device())
        model(x.to(dtype)).float().square().mean().backward()
        gr.finish()
        ag.reset()
        assert _held_bytes(model, buf) == persistent, strategy
        opt.step()
        buf.install_optimized_model_weights()
        buf.zero_grad_buffer()
        assert _held_bytes(model, buf) == buf.persistent_bytes() == persistent, strategy

    # Strategy 0 keeps every buffer whole: N times the ZeRO-3 shard, to the byte.
    assert held[0] == WORLD * held[3]
    # ZeRO-1 (fp32: main weights are the model weights' slice) holds as much as
    # strategy 0 in buffers, ZeRO-2 shards the grads.
    grads_bytes_3 = sum(g.main_grad_buffer.nbytes for g in buf.groups)
    if dtype == torch.float32:
        assert held[1] == held[0]
        assert held[2] == held[0] - (WORLD - 1) * grads_bytes_3
    else:  # bf16: the fp32 main weights are sharded from ZeRO-1 on
        main_bytes_3 = sum(g.main_weight_buffer.nbytes for g in buf.groups)
        assert held[1] == held[0] - (WORLD - 1) * main_bytes_3
        assert held[2] == held[1] - (WORLD - 1) * grads_bytes_3
    return rank


def test_memory_fp32():
    assert run_distributed(_memory, WORLD, args=(torch.float32,)) == list(range(WORLD))


def test_memory_bf16():
    assert run_distributed(_memory, WORLD, args=(torch.bfloat16,)) == list(range(WORLD))
