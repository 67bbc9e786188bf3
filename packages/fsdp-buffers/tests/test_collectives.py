"""Collectives through ParamAndGradBuffer on 1, 2, 3 and 4 ranks (gloo): gathers are
bit-exact, reductions give the mean (or sum) of known per-rank gradients, microbatches
accumulate like one large batch under every strategy, fp32 main weights reach bf16
compute weights, and ``broadcast_params`` makes replicated buffers agree.

Every rank builds the same model from a seed and can compute every other rank's
gradients from theirs, so each rank checks its own shard against exact expectations.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_mesh
from fsdp_buffers import (
    AllGatherPipeline,
    GradReducePipeline,
    ParamAndGradBuffer,
    fsdp_no_shard,
)
from fsdp_buffers.collectives import CollectiveKind
from fsdp_mesh.testing import run_distributed

WORLD_SIZES = [1, 2, 3, 4]
STRATEGIES = [0, 1, 2, 3]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d + 1)
        self.down = nn.Linear(2 * d + 1, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Odd(nn.Module):
    """Odd shapes: Linear(7, 5), Embedding(13, 3), a 1-d bias, a 0-d scale, an empty param."""

    def __init__(self, d: int = 5) -> None:
        super().__init__()
        self.lin = nn.Linear(7, d)
        self.emb = nn.Embedding(13, 3)
        self.mix = nn.Linear(3, d, bias=False)
        self.bias = nn.Parameter(torch.randn(d))
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.empty = nn.Parameter(torch.zeros(0, 3))
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, 2)

    def forward(self, x, idx):
        h = self.lin(x) + self.mix(self.emb(idx) + self.empty.sum()) + self.bias * self.scale
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _index():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    return fsdp_mesh.FSDPDistributedIndex(mesh, dp_shard_dim="dp")


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return Odd().to(dtype)


def _buffer(model, index, strategy, **kwargs):
    kwargs.setdefault("bucket_size", 40)  # several non-unit buckets
    return ParamAndGradBuffer(model, index, strategy=strategy, fsdp_unit_modules=[Block], **kwargs)


def _local(buf, name, full):
    """The part of ``full`` that this rank's optimizer view of ``name`` holds."""
    gid = next(g for n, g, _i, _p in buf.named_params() if n == name)
    if not buf.buckets[gid].sharding.main_weights:
        return full
    r0, r1 = buf.views.local_rows(name)
    if full.dim() == 0:
        return full if r1 > r0 else full.reshape(1)[:0]
    return full[r0:r1]


def _per_rank_grads(model, world, seed):
    """Known gradients for every rank: grads[r][name]."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(seed + 1000 * r)
        out.append({n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()})
    return out


def _gather_and_broadcast(alignment):
    rank, world = dist.get_rank(), dist.get_world_size()
    index = _index()
    for strategy in STRATEGIES:
        model = _model()
        expected = {n: p.detach().clone() for n, p in model.named_parameters()}
        buf = _buffer(model, index, strategy, alignment=alignment)
        assert buf.num_buckets >= 4
        ag = AllGatherPipeline(buf)
        # Before any gather, the local shards already hold the right rows.
        for name, shard in buf.views.local_shard_dtensors().items():
            assert torch.equal(shard.to_local(), _local(buf, name, expected[name])), name
        ag.all_gather_params(range(buf.num_buckets))
        for name, p in model.named_parameters():
            assert torch.equal(p, expected[name]), (strategy, name)
        gathers = buf.stats[CollectiveKind.ALL_GATHER].calls
        zero3 = strategy == 3 and world > 1
        distributed = [g.model_weight_buffer.is_data_distributed for g in buf.groups]
        # Only the scalar's group (0-d parameters stay replicated) is not gathered.
        assert sum(distributed) == (buf.num_buckets - 1 if zero3 else 0)
        assert gathers == sum(distributed), (strategy, gathers)
        ag.reset()
        if zero3:
            for name, p in model.named_parameters():
                assert (p.untyped_storage().size() == 0) == (p.dim() > 0), name
            ag.all_gather_params(range(buf.num_buckets))  # a second gather is exact too
            for name, p in model.named_parameters():
                assert torch.equal(p, expected[name]), (strategy, name)
            ag.reset()

        # broadcast_params: perturb every replicated buffer on ranks other than 0.
        buf.stats.reset()
        replicated = 0
        for group in buf.groups:
            for b in (group.model_weight_buffer, group.main_weight_buffer):
                if b is not None and not b.is_data_distributed:
                    replicated += 1
                    if rank != 0:
                        b.data.add_(1.0 + rank)
        buf.broadcast_params()
        assert buf.stats[CollectiveKind.BROADCAST].calls == replicated
        ag.all_gather_params(range(buf.num_buckets))
        for name, p in model.named_parameters():
            assert torch.equal(p, expected[name]), ("broadcast", strategy, name)
        ag.reset()
    return rank


def _bf16_broadcast_rederives_sharded_main_weights():
    rank = dist.get_rank()
    index = _index()
    for strategy in STRATEGIES:
        model = _model(torch.bfloat16)
        fsdp_no_shard(model.head)
        expected = {n: p.detach().clone() for n, p in model.named_parameters()}
        buf = _buffer(model, index, strategy)
        if rank != 0:
            for group in buf.groups:
                model_w, main_w = group.model_weight_buffer, group.main_weight_buffer
                if not model_w.is_data_distributed:
                    model_w.data.add_(1.0)
                    # Sharded main weights shadowing replicated model weights get
                    # re-derived from the broadcast model weights.
                    main_w.data.mul_(3.0).add_(1.0)
        buf.broadcast_params()
        ag = AllGatherPipeline(buf)
        ag.all_gather_params(range(buf.num_buckets))
        for name, p in model.named_parameters():
            value = expected[name]
            assert torch.equal(p, value), (strategy, name)
        for name, dparam in buf.views.optimizer_named_parameters():
            gid = next(g for n, g, _i, _p in buf.named_params() if n == name)
            if (
                buf.buckets[gid].sharding.main_weights
                and not buf.buckets[gid].sharding.model_weights
            ):
                want = _local(buf, name, expected[name].float())
                assert torch.equal(dparam.to_local(), want), (strategy, name)
        ag.reset()
    return rank


def _reduce():
    rank, world = dist.get_rank(), dist.get_world_size()
    index = _index()
    grads = _per_rank_grads(_model(), world, seed=7)
    total = {n: sum(g[n] for g in grads) for n in grads[0]}
    for strategy in STRATEGIES:
        for scaling, average in [(None, False), (1.0, False), (None, True), (1.0, True)]:
            model = _model()
            buf = _buffer(
                model,
                index,
                strategy,
                gradient_scaling_factor=scaling,
                average_in_collective=average,
            )
            gr = GradReducePipeline(buf)
            params = dict(model.named_parameters())
            # Grads arrive in an order unrelated to the reduce order.
            for name in sorted(params):
                params[name].grad = grads[rank][name].clone()
                gr.mark_param_grad_ready(params[name])
            gr.finish()
            # Taken into the buffer (autograd staging: when its bucket is packed).
            assert all(p.grad is None for p in params.values())
            assert not gr._inflight
            divisor = world if scaling is None else 1
            case = (strategy, scaling, average)
            for name, dparam in buf.views.optimizer_named_parameters():
                want = _local(buf, name, total[name] / divisor)
                torch.testing.assert_close(dparam.grad.to_local(), want, msg=f"{case} {name}")
                assert dparam.to_local().shape == dparam.grad.to_local().shape
            kinds = buf.stats.as_dict()
            scattered = sum(sh.main_weights for sh in (b.sharding for b in buf.buckets))
            # Every bucket but the scalar's (replicated) is reduce-scattered from ZeRO-1 up.
            assert scattered == (buf.num_buckets - 1 if strategy >= 1 and world > 1 else 0)
            assert kinds["reduce_scatter"]["calls"] == scattered
            assert kinds["all_reduce"]["calls"] == buf.num_buckets - scattered
            # The main-grad shards hold nothing but those rows: padding stays zero.
            for gid in range(buf.num_buckets):
                shard = buf.buckets[gid].grads.main_grad_shard()
                views = [
                    dparam.grad.to_local()
                    for name, dparam in buf.views.optimizer_named_parameters()
                    if dparam._fsdp_group_index[0] == gid
                ]
                if buf.buckets[gid].sharding.main_weights:
                    nonzero = sum(int(torch.count_nonzero(v)) for v in views)
                    assert int(torch.count_nonzero(shard)) == nonzero, (case, gid)
    return rank


def _batch(world, micro=3, b=2):
    g = torch.Generator().manual_seed(123)
    n = world * micro * b
    return (
        torch.randn(n, 7, generator=g),
        torch.randint(0, 13, (n,), generator=g),
        torch.randn(n, 2, generator=g),
    )


def _accumulate():
    rank, world = dist.get_rank(), dist.get_world_size()
    index = _index()
    micro, b = 3, 2
    x, idx, y = _batch(world, micro, b)
    ref = _model()
    nn.functional.mse_loss(ref(x, idx), y).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    one = _model()  # one microbatch, for after zero_grad_buffer
    nn.functional.mse_loss(one(x[: world * b], idx[: world * b]), y[: world * b]).backward()
    one_grads = {n: p.grad for n, p in one.named_parameters()}
    # sync_grads per microbatch, gradient_scaling_factor, average_in_collective: syncing
    # every microbatch rebases reduced grads (strategies 0 and 1); a sum (factor 1.0)
    # is the case where strategy 0's rebase is not the identity.
    cases = [
        ((True, True, True), None, False),  # a mean
        ((True, True, True), 1.0, False),  # a sum
        ((True, True, True), 1.0, True),  # a sum through ReduceOp.AVG
        ((False, False, True), None, False),  # no_sync, then one reduction
        ((True, False, True), 1.0, False),  # reduced, then no_sync on top, then reduced
    ]
    for strategy in STRATEGIES:
        for syncs, scaling, average in cases:
            no_sync = not all(syncs)
            case = f"strategy {strategy} syncs {syncs} scaling {scaling} avg {average}"
            model = _model()
            buf = _buffer(
                model,
                index,
                strategy,
                gradient_scaling_factor=scaling,
                average_in_collective=average,
            )
            ag, gr = AllGatherPipeline(buf), GradReducePipeline(buf)
            gr.register_grad_hooks()
            for m in range(micro):
                gr.sync_grads = syncs[m]
                rows = slice((m * world + rank) * b, (m * world + rank + 1) * b)
                ag.all_gather_params(range(buf.num_buckets))
                loss = nn.functional.mse_loss(model(x[rows], idx[rows]), y[rows]) / micro
                loss.backward()
                gr.finish()
                ag.reset()
            reduces = buf.stats[CollectiveKind.REDUCE_SCATTER].calls
            reduces += buf.stats[CollectiveKind.ALL_REDUCE].calls
            # no_sync skips reducing replicated grads only; sharded ones always go.
            expected = sum(
                micro if sh.grads else sum(syncs) for sh in (b.sharding for b in buf.buckets)
            )
            assert reduces == expected, (case, reduces)
            if no_sync and strategy < 2:
                assert reduces == sum(syncs) * buf.num_buckets
            scale = world if scaling == 1.0 else 1  # a sum is N times the mean
            for name, dparam in buf.views.optimizer_named_parameters():
                want = _local(buf, name, ref_grads[name] * scale)
                torch.testing.assert_close(
                    dparam.grad.to_local(), want, rtol=1e-5, atol=1e-6, msg=f"{case} {name}"
                )
            # zero_grad_buffer really starts afresh: one more microbatch is all there is.
            buf.zero_grad_buffer()
            gr.sync_grads = True
            rows = slice(rank * b, (rank + 1) * b)
            ag.all_gather_params(range(buf.num_buckets))
            nn.functional.mse_loss(model(x[rows], idx[rows]), y[rows]).backward()
            gr.finish()
            ag.reset()
            for name, dparam in buf.views.optimizer_named_parameters():
                want = _local(buf, name, one_grads[name] * scale)
                torch.testing.assert_close(
                    dparam.grad.to_local(), want, rtol=1e-5, atol=1e-6, msg=f"{case} {name}"
                )
    return rank


def _mixed_precision():
    rank = dist.get_rank()
    index = _index()
    for strategy in STRATEGIES:
        model = _model(torch.bfloat16)
        buf = _buffer(model, index, strategy)
        g = torch.Generator().manual_seed(99)
        new = {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
        assert all(grp.main_weight_buffer.dtype == torch.float32 for grp in buf.groups)
        assert all(grp.main_grad_buffer.dtype == torch.float32 for grp in buf.groups)
        with torch.no_grad():
            for name, dparam in buf.views.optimizer_named_parameters():
                assert dparam.dtype == torch.float32
                dparam.to_local().copy_(_local(buf, name, new[name]))
        buf.install_optimized_model_weights()
        ag = AllGatherPipeline(buf)
        ag.all_gather_params(range(buf.num_buckets))
        for name, p in model.named_parameters():
            assert p.dtype == torch.bfloat16
            assert torch.equal(p, new[name].to(torch.bfloat16)), (strategy, name)
        # The fp32 main weights keep their full precision.
        for name, dparam in buf.views.optimizer_named_parameters():
            assert torch.equal(dparam.to_local(), _local(buf, name, new[name])), (strategy, name)
        ag.reset()
    return rank


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_gather_is_exact_and_broadcast_syncs_replicas(world):
    for alignment in (1, 64):
        assert run_distributed(_gather_and_broadcast, world, args=(alignment,)) == list(
            range(world)
        )


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_bf16_broadcast_rederives_sharded_main_weights(world):
    assert run_distributed(_bf16_broadcast_rederives_sharded_main_weights, world) == list(
        range(world)
    )


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_reduce_gives_mean_or_sum(world):
    assert run_distributed(_reduce, world) == list(range(world))


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_microbatches_accumulate_like_one_batch(world):
    assert run_distributed(_accumulate, world, timeout=120) == list(range(world))


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_fp32_main_weights_reach_bf16_compute_weights(world):
    assert run_distributed(_mixed_precision, world) == list(range(world))


def test_reference_model_uses_every_parameter():
    # Guards the parity tests above: every parameter, the empty one included, gets a grad.
    model = _model()
    x, idx, y = _batch(1)
    nn.functional.mse_loss(model(x, idx), y).backward()
    assert all(p.grad is not None for p in model.parameters())
    assert copy.deepcopy(model).empty.shape == (0, 3)


def _direct_and_replaced_paths() -> None:
    """Note [direct collectives]: a member group's plain tensors go to the process
    group's own method (torch's Python function is not called); a torch.distributed
    function someone replaced is called instead, so a tool observing it sees ours; both
    give the same values."""
    from fsdp_buffers import collectives

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    calls: list[str] = []
    torch_fns = {
        "all_gather_into_tensor": dist.all_gather_into_tensor,
        "reduce_scatter_tensor": dist.reduce_scatter_tensor,
        "all_reduce": dist.all_reduce,
    }

    def observed(name):
        def fn(*args, **kwargs):
            calls.append(name)
            return torch_fns[name](*args, **kwargs)

        return fn

    shard = torch.arange(3, dtype=torch.float32) + 10 * rank
    full = torch.cat([torch.arange(3, dtype=torch.float32) + 10 * r for r in range(world)])
    unsharded = torch.arange(3 * world, dtype=torch.float32) * (rank + 1)
    summed = torch.arange(3 * world, dtype=torch.float32) * sum(range(1, world + 1))
    for replaced in (False, True):
        calls.clear()
        if replaced:
            for name in torch_fns:
                setattr(dist, name, observed(name))
        try:
            out = torch.empty(3 * world)
            collectives.all_gather(out, shard, group).wait()
            assert torch.equal(out, full)
            piece = torch.empty(3)
            collectives.reduce_scatter(piece, unsharded, group).wait()
            assert torch.equal(piece, summed[3 * rank : 3 * rank + 3])
            t = torch.ones(2)
            collectives.all_reduce(t, group).wait()
            assert torch.equal(t, torch.full((2,), float(world)))
        finally:
            for name, fn in torch_fns.items():
                setattr(dist, name, fn)
        assert calls == (list(torch_fns) if replaced else []), (replaced, calls)


def test_direct_collectives_and_replaced_functions():
    run_distributed(_direct_and_replaced_paths, 2)
