"""Note [rank-major staging] on 2 ranks (gloo): from a bucket's second backward on,
sharded gradients stage rank-major (no ``main_grad`` views, no zeroing pass, no pack
copy); the reduced gradients are the same bits as the first backward's, which staged
parameter-major, with ragged ``torch.chunk`` pieces, 0-d (replicated) parameters, whole
placement, parameters without a gradient, and a gradient arriving twice. A fused write
(``grad_added_to_main_grad``), or a parameter that never got a gradient, keeps the bucket
parameter-major; a fused write arriving only once it stages rank-major raises.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_mesh
from fsdp_buffers import GradReducePipeline, ParamAndGradBuffer, fsdp_whole_placement
from fsdp_buffers.layout import compute_layout
from fsdp_mesh.testing import run_distributed


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)  # 3 rows over 2 ranks: ragged pieces
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-d: a replicated slot
        self.mat = nn.Parameter(torch.randn(4, 6))
        self.sometimes = nn.Parameter(torch.randn(7))  # no gradient in some backwards


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])


def _setup(strategy, whole):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    index = fsdp_mesh.FSDPDistributedIndex(mesh, dp_shard_dim="dp")
    torch.manual_seed(0)
    model = Net()
    if whole:
        fsdp_whole_placement([b.mat for b in model.blocks] + [model.blocks[0].lin.weight])
    buf = ParamAndGradBuffer(model, index, strategy=strategy, fsdp_unit_modules=[Block])
    return model, buf


def _backward(model, buf, gr, rank, step, fused=(), skip=()):
    """One backward's gradients (the same every step), bucket by bucket in backward
    order; ``lin.bias`` gets its gradient in two parts, as a parameter used twice."""
    g = torch.Generator().manual_seed(7 + 100 * rank)
    grads = {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    for gid in reversed(range(len(buf.groups))):
        gr.prepare(gid)
        for name in buf.groups[gid].names:
            if name in skip:
                continue
            p = params[name]
            if name in fused:
                # As Transformer Engine does: into main_grad, or a new tensor without it.
                out = p.main_grad if p.main_grad is not None else torch.zeros_like(p)
                out.add_(grads[name])
                p.grad = torch.zeros_like(p)
                p.grad_added_to_main_grad = True
            elif name.endswith("lin.bias"):
                half = grads[name] * 0.5
                p.grad = half
                gr.accumulate(p)
                p.grad = grads[name] - half
            else:
                p.grad = grads[name]
            gr.mark_param_grad_ready(p)
    gr.finish()
    return grads


def _same_bits_every_step(strategy, whole):
    rank, world = dist.get_rank(), dist.get_world_size()
    model, buf = _setup(strategy, whole)
    gr = GradReducePipeline(buf)
    staged = [b.gid for b in buf.buckets if b.sharding.grads]
    assert staged and (not whole or any(b.layout.has_whole for b in buf.buckets))
    first = None
    for step in range(4):
        skip = {f"blocks.{i}.sometimes" for i in range(3)} if step == 2 else set()
        grads = _backward(model, buf, gr, rank, step, skip=skip)
        shards = [buf.buckets[gid].main_grad_shard().clone() for gid in staged]
        if step == 2:  # what the skipped parameters had is zero now
            for j, gid in enumerate(staged):
                bucket = buf.buckets[gid]
                for i, name in enumerate(bucket.group.names):
                    if name in skip:
                        start = bucket.layout.rank_offset(i, rank)
                        width = bucket.layout.rank_width(i, rank)
                        assert shards[j][start : start + width].count_nonzero() == 0
                        shards[j][start : start + width] = first[j][start : start + width]
        if first is None:
            first = shards
            # Parameter-major staging, checked against the mean over ranks.
            everyone = [None] * world
            dist.all_gather_object(everyone, grads)
            for name, dparam in buf.views.optimizer_named_parameters():
                if whole and name.endswith(("mat", "0.lin.weight")):
                    continue  # whole-placed: covered by the same-bits check below
                want = sum(g[name] for g in everyone) / world
                r0, r1 = buf.views.local_rows(name)
                got = dparam.grad.to_local()
                torch.testing.assert_close(got, want[r0:r1] if want.dim() else want)
        else:
            for gid, a, b in zip(staged, first, shards, strict=True):
                assert torch.equal(a, b), (step, gid)  # the same bits, staged rank-major
        for gid in staged:
            gr.prepare(gid)
            mode = [p.main_grad is None for p in buf.groups[gid].params]
            assert all(mode), (step, gid)  # rank-major from the second backward on
        buf.zero_grad_buffer()
    return rank


@pytest.mark.parametrize("strategy", [2, 3])
@pytest.mark.parametrize("whole", [False, True])
def test_rank_major_staging_gives_the_same_bits(strategy, whole):
    assert run_distributed(_same_bits_every_step, 2, args=(strategy, whole), timeout=60) == [0, 1]


def _fused_writes():
    rank = dist.get_rank()
    model, buf = _setup(3, False)
    gr = GradReducePipeline(buf)
    fused, never = {"blocks.1.mat"}, {"blocks.0.lin.bias"}
    first = None
    for step in range(3):  # the fused bucket stays parameter-major: main_grad exists
        _backward(model, buf, gr, rank, step, fused=fused, skip=never)
        shards = [b.main_grad_shard().clone() for b in buf.buckets]
        if first is None:
            first = shards
        assert all(torch.equal(a, b) for a, b in zip(first, shards, strict=True))
        for bucket in buf.buckets:
            gr.prepare(bucket.gid)
            views = [p.main_grad is not None for p in bucket.group.params]
            # A parameter that never got a gradient, or a fused write: main_grad views.
            keep = not bucket.sharding.grads or any(n in fused | never for n in bucket.group.names)
            assert all(views) == keep and any(views) == keep, (step, bucket.gid)
        buf.zero_grad_buffer()
    # A fused write first seen once the bucket stages rank-major: a clear error.
    with pytest.raises(RuntimeError, match="grad_added_to_main_grad=True in a backward"):
        _backward(model, buf, gr, rank, 3, fused={"blocks.2.lin.weight"})
    return rank


def test_fused_writes_keep_main_grad_views_and_late_ones_raise():
    assert run_distributed(_fused_writes, 2, timeout=60) == [0, 1]


@pytest.mark.parametrize(
    ("shards", "owners", "coarse"),
    [(2, None, None), (4, None, None), (4, None, 2), (2, [None, 1, None, 0, None], None)],
)
def test_staging_targets_match_pack(shards, owners, coarse):
    """Writing gradients into ``staging_targets`` (first copied, then added; one
    parameter missing) gives exactly ``pack`` of the zeroed parameter-major bucket."""
    shapes = [(8, 4), (5, 3), (), (6, 2), (3,)]
    layout = compute_layout(shapes, shards, 16, owners)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    pm = torch.zeros(layout.total_numel)
    for i, grad in enumerate(grads[:-1]):  # the last one never gets a gradient
        start = layout.param_offset(i)
        pm[start : start + grad.numel()] = grad.reshape(-1)
    want = torch.empty(layout.total_numel)
    layout.pack(pm, want, coarse)
    rm = torch.full((layout.total_numel,), float("nan"))  # garbage before any write
    targets = layout.staging_targets(rm, coarse)
    for i, grad in enumerate(grads[:-1]):
        half = grad * 0.5
        targets.write(i, half, True)
        targets.write(i, grad - half, False)
    targets.zero_rest([True] * (len(shapes) - 1) + [False])
    assert torch.equal(rm, want)


def _grads_with_history():
    """Gradients that carry autograd history (a ``create_graph=True`` backward, whose
    hooks run with grad mode on), staged parameter-major then rank-major: the buffers
    record no history, and hold the same bits as plain gradients do."""
    rank = dist.get_rank()
    out = []
    for history in (False, True):
        _model, buf = _setup(3, False)
        gr = GradReducePipeline(buf)
        staged = [b.gid for b in buf.buckets if b.sharding.grads]
        shards = []
        for step in range(2):
            g = torch.Generator().manual_seed(7 + 100 * rank)
            for gid in reversed(range(len(buf.groups))):
                gr.prepare(gid)
                for p in buf.groups[gid].params:
                    grad = torch.randn(p.shape, generator=g)
                    if history:
                        grad = grad.requires_grad_() * 1.0
                        assert grad.grad_fn is not None
                    p.grad = grad
                    with torch.enable_grad():
                        gr.mark_param_grad_ready(p)
            gr.finish()
            for gid in staged:
                data = buf.groups[gid].main_grad_buffer.data
                assert not data.requires_grad and data.grad_fn is None, (history, step, gid)
            shards.append([buf.buckets[gid].main_grad_shard().clone() for gid in staged])
            buf.zero_grad_buffer()
        out.append(shards)
    for plain, traced in zip(*out, strict=True):
        for a, b in zip(plain, traced, strict=True):
            assert torch.equal(a, b)
    return rank


def test_gradients_with_history_leave_no_history_in_the_buffers():
    assert run_distributed(_grads_with_history, 2, timeout=60) == [0, 1]
