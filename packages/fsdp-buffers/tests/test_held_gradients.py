"""Note [held gradients] on 2 ranks (gloo): a rank-major staging bucket is made by the
first gradient past 1/8 of it, not at ``prepare``; smaller gradients before it are held
aside (a second one for the same parameter added), then written first. The reduced
gradients are the same bits as the first backward's, which staged parameter-major, and
the mean over ranks; the reduction writes what is still held; ``zero_grad_buffer``
drops held gradients of a backward that never reduced.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_mesh
from fsdp_buffers import GradReducePipeline, ParamAndGradBuffer
from fsdp_mesh.testing import run_distributed


class Root(nn.Module):
    """As a GPT's root bucket: a final norm whose small gradients come first, an
    embedding (almost all of the bucket) whose gradient comes last."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Parameter(torch.randn(64, 8))
        self.norm_w = nn.Parameter(torch.randn(8))
        self.norm_b = nn.Parameter(torch.randn(8))


def _setup(strategy):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    index = fsdp_mesh.FSDPDistributedIndex(mesh, dp_shard_dim="dp")
    torch.manual_seed(0)
    model = Root()
    buf = ParamAndGradBuffer(model, index, strategy=strategy)
    assert len(buf.buckets) == 1 and buf.buckets[0].sharding.grads
    return model, buf


def _grads(model, rank, step):
    g = torch.Generator().manual_seed(11 + 100 * rank + step)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def _staged(buf) -> bool:
    gbuf = buf.buckets[0].group.main_grad_buffer
    return gbuf.allocator.is_allocated(gbuf)


def _backward(model, buf, gr, grads, check, skip_emb=False):
    """The norm's gradients (``norm_b``'s in two parts), then the embedding's. ``check``:
    the staging bucket is made only by the embedding's."""
    gr.prepare(0)
    if check:
        assert not _staged(buf), "prepare made a rank-major staging bucket"
    half = grads["norm_b"] * 0.5
    arrivals = [
        ("norm_w", grads["norm_w"]),
        ("norm_b", half),
        ("norm_b", grads["norm_b"] - half),
    ]
    if not skip_emb:
        arrivals.append(("emb", grads["emb"]))
    params = dict(model.named_parameters())
    for name, grad in arrivals:
        params[name].grad = grad.clone()
        gr.accumulate(params[name])
        assert params[name].grad is None  # taken, held or written
        if check:
            assert _staged(buf) == (name == "emb"), name
    gr.finish()


def _held(strategy):
    rank, world = dist.get_rank(), dist.get_world_size()
    model, buf = _setup(strategy)
    gr = GradReducePipeline(buf)
    bucket = buf.buckets[0]
    shards = []
    for step in range(3):  # the first backward stages parameter-major; then held
        grads = _grads(model, rank, 0)
        _backward(model, buf, gr, grads, check=step > 0)
        shards.append(bucket.main_grad_shard().clone())
        if step == 0:
            everyone = [None] * world
            dist.all_gather_object(everyone, grads)
            for name, dparam in buf.views.optimizer_named_parameters():
                want = sum(g[name] for g in everyone) / world
                r0, r1 = buf.views.local_rows(name)
                torch.testing.assert_close(dparam.grad.to_local(), want[r0:r1])
        buf.zero_grad_buffer()
    assert all(torch.equal(shards[0], s) for s in shards[1:])

    # Only held gradients when the bucket is reduced: the reduction writes them.
    grads = _grads(model, rank, 1)
    _backward(model, buf, gr, grads, check=False, skip_emb=True)
    everyone = [None] * world
    dist.all_gather_object(everyone, grads)
    for name, dparam in buf.views.optimizer_named_parameters():
        want = sum(g[name] for g in everyone) / world
        if name == "emb":
            want = torch.zeros_like(want)
        r0, r1 = buf.views.local_rows(name)
        torch.testing.assert_close(dparam.grad.to_local(), want[r0:r1])
    buf.zero_grad_buffer()

    # A backward that raised after holding: zero_grad_buffer drops what it held.
    params = dict(model.named_parameters())
    gr.prepare(0)
    params["norm_w"].grad = torch.full((8,), 1e6)
    gr.accumulate(params["norm_w"])
    assert bucket._held and not _staged(buf)
    gr.abort()
    buf.zero_grad_buffer()
    assert not bucket._held
    _backward(model, buf, gr, _grads(model, rank, 0), check=True)
    assert torch.equal(bucket.main_grad_shard(), shards[0])
    return rank


@pytest.mark.parametrize("strategy", [2, 3])
def test_small_gradients_wait_for_the_staging_bucket(strategy):
    assert run_distributed(_held, 2, args=(strategy,), timeout=60) == [0, 1]
