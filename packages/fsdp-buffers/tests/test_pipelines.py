"""AllGatherPipeline and GradReducePipeline on 2 ranks (gloo): bucket states, prefetch
within the byte budget, buckets that need no collective, release, reduce order, the
in-flight limit, gradients that never arrive on one rank, and gradients that arrive late.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_mesh
from fsdp_buffers import (
    AllGatherPipeline,
    BucketStatus,
    GradReducePipeline,
    ParamAndGradBuffer,
    PrefetchOrder,
    fsdp_no_shard,
)
from fsdp_buffers.collectives import CollectiveKind
from fsdp_mesh.testing import run_distributed

EMPTY = BucketStatus.EMPTY
IN_PROGRESS = BucketStatus.GATHER_IN_PROGRESS
READY = BucketStatus.READY_TO_USE
FORWARD = PrefetchOrder.FORWARD_PASS_ORDER
BACKWARD = PrefetchOrder.BACKWARD_PASS_ORDER


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)


class Net(nn.Module):
    """Buckets: 0 = inp (no unit), 1..4 = the four blocks, 5 = vit (fsdp_no_shard).
    Every bucket holds 72 elements, so every bucket has the same unsharded bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.vit = fsdp_no_shard(nn.Linear(8, 8))


def _setup(strategy=3, seed=0, **kwargs):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    index = fsdp_mesh.FSDPDistributedIndex(mesh, dp_shard_dim="dp")
    torch.manual_seed(seed)
    model = Net()
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    buf = ParamAndGradBuffer(model, index, strategy=strategy, fsdp_unit_modules=[Block], **kwargs)
    assert [g.names[0] for g in buf.groups] == [
        "inp.weight",
        *(f"blocks.{i}.lin.weight" for i in range(4)),
        "vit.weight",
    ]
    return model, expected, buf


def _gathers(buf):
    return buf.stats[CollectiveKind.ALL_GATHER].calls


def _bucket_bytes(buf, gid):
    return buf.groups[gid].model_weight_buffer.unsharded_tensor().untyped_storage().size()


def _check_params(model, expected, prefixes):
    params = dict(model.named_parameters())
    for name, value in expected.items():
        if name.startswith(prefixes):
            assert torch.equal(params[name], value), name


def _all_gather_pipeline():
    model, expected, buf = _setup()
    ag = AllGatherPipeline(buf)
    bucket = buf.buckets[1].unsharded_bytes
    assert all(buf.buckets[g].unsharded_bytes == bucket for g in range(6))
    assert ag.prefetch_budget_bytes == bucket  # one unit ahead by default
    assert [ag.is_distributed(g) for g in range(6)] == [True] * 5 + [False]
    assert ag.status == [EMPTY] * 5 + [READY]  # the no_shard bucket is ready from the start
    assert ag.gathered_buckets() == []

    # One bucket through its states.
    ag.async_bucket_gather(1)
    assert ag.status[1] is IN_PROGRESS and _gathers(buf) == 1
    assert _bucket_bytes(buf, 1) == 0  # fetched when the gather lands, as FSDP2's
    ag.async_bucket_gather(1)  # already under way: nothing new
    assert _gathers(buf) == 1 and ag.gathered_buckets() == [1]
    ag.wait_bucket_ready(1)
    assert ag.status[1] is READY and _bucket_bytes(buf, 1) == bucket
    _check_params(model, expected, ("blocks.0.",))
    ag.release_bucket(1)
    assert ag.status[1] is EMPTY and _bucket_bytes(buf, 1) == 0
    assert model.blocks[0].lin.weight.untyped_storage().size() == 0
    # wait_bucket_ready on an EMPTY bucket gathers it; release while in flight waits first.
    ag.wait_bucket_ready(2)
    assert ag.status[2] is READY and _gathers(buf) == 2
    _check_params(model, expected, ("blocks.1.",))
    ag.async_bucket_gather(3)
    ag.release_bucket(3)
    assert ag.status[3] is EMPTY and _bucket_bytes(buf, 3) == 0 and not ag.buckets[3]._gather
    ag.reset()
    assert ag.status == [EMPTY] * 5 + [READY]
    assert all(_bucket_bytes(buf, g) == 0 for g in range(5))

    # Forward prefetch: one bucket ahead within a budget of one bucket.
    buf.stats.reset()
    ag.all_gather_params([1])
    assert ag.status == [EMPTY, READY, IN_PROGRESS, EMPTY, EMPTY, READY]
    assert _gathers(buf) == 2
    ag.all_gather_params([2])
    assert ag.status == [EMPTY, READY, READY, IN_PROGRESS, EMPTY, READY]
    assert _gathers(buf) == 3  # bucket 2 was not gathered twice
    _check_params(model, expected, ("blocks.0.", "blocks.1."))
    ag.release_bucket(1)
    ag.all_gather_params([3], wait_bucket_ready=False)
    assert ag.status == [EMPTY, EMPTY, READY, IN_PROGRESS, IN_PROGRESS, READY]
    assert _gathers(buf) == 4
    ag.all_gather_params([4])  # nothing after 4 is distributed: no prefetch
    assert ag.status[4] is READY and ag.status[3] is IN_PROGRESS and _gathers(buf) == 4
    ag.reset()
    assert ag.status == [EMPTY] * 5 + [READY] and not ag.buckets[3]._gather

    # Backward prefetch walks the other way.
    buf.stats.reset()
    ag.all_gather_params([4], prefetch_order=BACKWARD)
    assert ag.status == [EMPTY, EMPTY, EMPTY, IN_PROGRESS, READY, READY]
    ag.all_gather_params([3], prefetch_order=BACKWARD)
    assert ag.status == [EMPTY, EMPTY, IN_PROGRESS, READY, READY, READY]
    assert _gathers(buf) == 3
    _check_params(model, expected, ("blocks.2.", "blocks.3."))
    ag.reset()

    # No prefetch when asked not to, or when the budget is below one bucket.
    buf.stats.reset()
    ag.all_gather_params([1], prefetch=False)
    assert ag.status == [EMPTY, READY, EMPTY, EMPTY, EMPTY, READY] and _gathers(buf) == 1
    ag.reset()
    small = AllGatherPipeline(buf, prefetch_budget_bytes=bucket - 1)
    small.all_gather_params([0])
    assert small.status == [READY, EMPTY, EMPTY, EMPTY, EMPTY, READY] and _gathers(buf) == 2
    small.reset()

    # A budget of two buckets: two ahead; buckets already gathered count against it.
    buf.stats.reset()
    two = AllGatherPipeline(buf, prefetch_budget_bytes=2 * bucket)
    two.all_gather_params([0])
    assert two.status == [READY, IN_PROGRESS, IN_PROGRESS, EMPTY, EMPTY, READY]
    assert _gathers(buf) == 3
    two.all_gather_params([1])
    assert two.status == [READY, READY, IN_PROGRESS, IN_PROGRESS, EMPTY, READY]
    assert _gathers(buf) == 4
    two.reset()

    # Prefetch skips a bucket that is not distributed (the no_shard bucket 5 sits
    # between 1 and 2 in this forward order) and issues nothing for it.
    buf.stats.reset()
    mixed = AllGatherPipeline(buf, forward_order=[0, 1, 5, 2, 3, 4])
    mixed.all_gather_params([1])
    assert mixed.status == [EMPTY, READY, IN_PROGRESS, EMPTY, EMPTY, READY]
    assert _gathers(buf) == 2
    mixed.reset()
    buf.stats.reset()
    mixed.all_gather_params([5], prefetch=False)  # the no_shard bucket: no collective
    mixed.wait_bucket_ready(5)
    mixed.release_bucket(5)  # a no-op: it stays READY
    assert mixed.status[5] is READY and _gathers(buf) == 0
    mixed.all_gather_params([5])  # its prefetch gathers what follows it, bucket 2
    assert mixed.status == [EMPTY, EMPTY, IN_PROGRESS, EMPTY, EMPTY, READY]
    assert _gathers(buf) == 1
    mixed.reset()
    _check_params(model, expected, ("vit.",))
    with pytest.raises(ValueError, match=r"forward_order must be a permutation of the 6"):
        AllGatherPipeline(buf, forward_order=[0, 1, 2, 3, 4, 4])

    # Below ZeRO-3 nothing is distributed: every bucket READY, no collective unless a
    # step left buckets STALE (ZeRO-1/2, Note [stale buckets]), which the budget counts.
    for strategy in (0, 1, 2):
        model, expected, buf = _setup(strategy)
        ag = AllGatherPipeline(buf)
        assert ag.status == [READY] * 6
        assert (ag.prefetch_budget_bytes == 0) == (strategy == 0)
        ag.all_gather_params(range(6))
        ag.all_gather_params([0], prefetch_order=BACKWARD)
        ag.release_bucket(2)
        ag.reset()
        assert ag.status == [READY] * 6 and _gathers(buf) == 0
        assert ag.gathered_buckets() == []
        _check_params(model, expected, ("",))
        stale = [g for g in range(6) if buf.buckets[g].can_be_stale]
        assert bool(stale) == (strategy > 0)
        if stale:
            buf.install_optimized_model_weights(stale=range(6))
            assert [s is BucketStatus.STALE for s in ag.status] == [g in stale for g in range(6)]
            # Asking for the last one (root buckets come first) gathers every stale one
            # before it first, in that order.
            roots = buf.root_groups
            order = [g for g in roots if g in stale] + [g for g in stale if g not in roots]
            ag.all_gather_params([order[-1]], prefetch=False)
            assert ag.status == [READY] * 6 and _gathers(buf) == len(stale)
            ag.reset()
            assert ag.status == [READY] * 6  # release keeps replicated weights
            _check_params(model, expected, ("",))
    return dist.get_rank()


def _grads(model, rank, seed=5):
    g = torch.Generator().manual_seed(seed + 100 * rank)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def _reduced(buf, name):
    """This rank's reduced gradient rows of ``name`` and the rows they are."""
    dparam = dict(buf.views.optimizer_named_parameters())[name]
    gid = dparam._fsdp_group_index[0]
    rows = buf.views.local_rows(name) if buf.buckets[gid].sharding.main_weights else None
    return dparam.grad.to_local(), rows


def _expect(grads_by_rank, name, rows, present):
    total = sum(g[name] for r, g in enumerate(grads_by_rank) if present(r, name))
    want = total / len(grads_by_rank)
    return want if rows is None else want[rows[0] : rows[1]]


def _agree(late: list[bool]) -> list[bool]:
    """The hook layer's agreement: a bucket some rank flags is flagged on every rank."""
    flags = torch.tensor(late, dtype=torch.uint8)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [bool(x) for x in flags.tolist()]


def _logging(gr, buf, log):
    issued = []

    def wrap(bucket):
        start = bucket.grads.start_reduce

        def wrapped():
            not_done = sum(not p.done for p in issued)
            assert not_done < gr.max_inflight, "launching past max_inflight"
            log.append((bucket.gid, not_done))
            pending = start()
            issued.append(pending)
            return pending

        bucket.grads.start_reduce = wrapped

    for bucket in buf.buckets:
        wrap(bucket)


def _grad_reduce_pipeline():
    rank, world = dist.get_rank(), dist.get_world_size()
    for strategy in (0, 3):
        # Reduce order and the in-flight limit.
        for max_inflight in (1, 2, 3):
            model, _, buf = _setup(strategy)
            gr = GradReducePipeline(buf, max_inflight=max_inflight)
            assert gr.reduce_order == [5, 4, 3, 2, 1, 0]
            log = []
            _logging(gr, buf, log)
            grads = [_grads(model, r) for r in range(world)]
            params = dict(model.named_parameters())
            for gid in range(6):  # forward order: nothing can launch before bucket 5
                for name in buf.groups[gid].names:
                    params[name].grad = grads[rank][name].clone()
                    gr.mark_param_grad_ready(params[name])
                if gid < 5:
                    assert log == []
            assert [g for g, _ in log] == [5, 4, 3, 2, 1, 0]
            assert max(n for _, n in log) == max_inflight - 1  # the limit is reached
            assert len(gr._inflight) <= max_inflight
            gr.finish()
            assert gr.inflight == 0 and [g for g, _ in log] == [5, 4, 3, 2, 1, 0]
            for name in params:
                got, rows = _reduced(buf, name)
                torch.testing.assert_close(got, _expect(grads, name, rows, lambda r, n: True))

        # Buckets launch as soon as they and all before them in reduce order are in.
        model, _, buf = _setup(strategy)
        gr = GradReducePipeline(buf)
        log = []
        _logging(gr, buf, log)
        params = dict(model.named_parameters())
        grads = _grads(model, rank)
        for gid in (5, 3, 4, 1, 2, 0):
            for name in buf.groups[gid].names:
                params[name].grad = grads[name].clone()
                gr.mark_param_grad_ready(params[name])
            launched = [g for g, _ in log]
            assert launched == {5: [5], 3: [5], 4: [5, 4, 3], 1: [5, 4, 3],
                                2: [5, 4, 3, 2, 1], 0: [5, 4, 3, 2, 1, 0]}[gid]  # fmt: skip
        gr.finish()

        # A custom reduce order is followed; finish() launches what never came, in order.
        model, _, buf = _setup(strategy)
        gr = GradReducePipeline(buf, reduce_order=[0, 1, 2, 3, 4, 5])
        log = []
        _logging(gr, buf, log)
        params = dict(model.named_parameters())
        for name in buf.groups[2].names:
            params[name].grad = torch.ones_like(params[name])
            gr.mark_param_grad_ready(params[name])
        assert log == []
        gr.finish()
        assert [g for g, _ in log] == [0, 1, 2, 3, 4, 5]
        for name in params:
            got, _ = _reduced(buf, name)
            assert torch.all(got == (1.0 if name.startswith("blocks.1.") else 0.0)), name

        with pytest.raises(ValueError, match=r"reduce_order must list each trainable bucket"):
            GradReducePipeline(buf, reduce_order=[0, 1, 2, 3, 4])
        with pytest.raises(ValueError, match=r"max_inflight must be at least 1; got 0"):
            GradReducePipeline(buf, max_inflight=0)
    return rank


def _unused_on_one_rank(strategy):
    """Rank 0 uses every parameter; rank 1 never uses ``blocks.1.lin.bias`` (its
    bucket's other parameter does arrive) nor anything of ``blocks.2`` (a whole bucket,
    early in reduce order). The reduction must be the mean with zeros standing in."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _, buf = _setup(strategy)
    gr = GradReducePipeline(buf)
    params = dict(model.named_parameters())
    grads = [_grads(model, r) for r in range(world)]

    def used(r, name):
        return r == 0 or not (name == "blocks.1.lin.bias" or name.startswith("blocks.2."))

    for name in reversed(list(params)):  # backward order
        if used(rank, name):
            params[name].grad = grads[rank][name].clone()
            gr.mark_param_grad_ready(params[name])
    gr.finish()
    for name in params:
        got, rows = _reduced(buf, name)
        torch.testing.assert_close(got, _expect(grads, name, rows, used), msg=name)
    unused = _reduced(buf, "blocks.1.lin.bias")[0]
    if unused.numel():
        assert torch.count_nonzero(unused) > 0  # rank 0's half really arrived

    # Late gradient: without an agreement across ranks (the hook layer's), finish()
    # refuses a gradient that came after its bucket was reduced, naming the bucket.
    model, _, buf = _setup(strategy)
    gr = GradReducePipeline(buf)
    vit = model.vit.weight
    for p in (model.vit.weight, model.vit.bias):
        p.grad = torch.full_like(p, 2.0)
        gr.mark_param_grad_ready(p)
    vit.grad = torch.full_like(vit, 100.0)
    gr.mark_param_grad_ready(vit)
    with pytest.raises(
        RuntimeError, match=r"arrived after their bucket was reduced \(\[.*bucket 5"
    ):
        gr.finish()
    got, _ = _reduced(buf, "vit.weight")
    assert torch.all(got == 2.0)  # the late gradient was not added

    # With an agreement, it is reduced at the end of backward, on every rank.
    model, _, buf = _setup(strategy)
    gr = GradReducePipeline(buf)
    for p in (model.vit.weight, model.vit.bias):
        p.grad = torch.full_like(p, 2.0)
        gr.mark_param_grad_ready(p)
    if rank == 0:  # one rank only: the agreement makes both reduce again
        model.vit.weight.grad = torch.full_like(model.vit.weight, 100.0)

    gr.finish(agree=_agree)
    got, _ = _reduced(buf, "vit.weight")
    assert torch.all(got == 2.0 + 100.0 / world), got  # the mean, late gradient included
    return rank


def _double_buffer():
    """fsdp_double_buffer: units' weight buckets take turns in two persistent slots,
    driven the way the hook layer drives them (root bucket gathered for the whole step,
    one unit of prefetch), through a forward, a backward and the reductions."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, expected, buf = _setup(3, fsdp_double_buffer=True)
    ag, gr = AllGatherPipeline(buf), GradReducePipeline(buf)

    def ptr(gid):
        return buf.groups[gid].model_weight_buffer.unsharded_tensor().data_ptr()

    assert ptr(1) == ptr(3) and ptr(2) == ptr(4) and ptr(1) != ptr(2)
    assert ptr(0) not in (ptr(1), ptr(2))  # the root bucket is not in the slots
    ag.all_gather_params([0], prefetch=False)
    for gid in (1, 2, 3, 4):
        ag.all_gather_params([gid])
        _check_params(model, expected, (f"blocks.{gid - 1}.",))
        ag.release_bucket(gid)
    _check_params(model, expected, ("inp.",))
    params = dict(model.named_parameters())
    grads = [_grads(model, r) for r in range(world)]

    def backward(gid):
        for name in buf.groups[gid].names:
            params[name].grad = grads[rank][name].clone()
            gr.mark_param_grad_ready(params[name])

    for gid in (4, 3, 2, 1):
        ag.all_gather_params([gid], prefetch_order=BACKWARD)
        _check_params(model, expected, (f"blocks.{gid - 1}.",))
        backward(gid)
        ag.release_bucket(gid)
    backward(5)
    backward(0)
    gr.finish()
    ag.reset()
    for name in params:
        got, rows = _reduced(buf, name)
        torch.testing.assert_close(got, _expect(grads, name, rows, lambda r, n: True))
    # A third unit while two are held is refused, on every rank, before any collective.
    ag.all_gather_params([1, 2], prefetch=False)
    with pytest.raises(RuntimeError, match=r"slot 0 is still held by unit\(s\) \[0\] while unit 2"):
        ag.all_gather_params([3], prefetch=False)
    assert ag.status[3] is EMPTY
    ag.release_bucket(1)
    ag.all_gather_params([3], prefetch=False)
    _check_params(model, expected, ("blocks.1.", "blocks.2."))
    ag.reset()
    return rank


def _main_grad_protocol():
    """A framework that accumulates weight gradients itself writes ``param.main_grad``
    (and sets ``grad_added_to_main_grad``). Replicated gradients: it always exists.
    Sharded ones (ZeRO-2/3): it exists from ``prepare`` (or the first gradient) until
    the bucket's reduction is launched, and is None otherwise, never a view of freed or
    reused memory. Written this way, the reduced gradients are the mean over ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for strategy in (0, 1, 2, 3):
        for double_buffer in (False, True):
            model, _, buf = _setup(
                strategy, fsdp_double_buffer=double_buffer, grad_staging="main_grad"
            )
            gr = GradReducePipeline(buf)
            params = dict(model.named_parameters())
            staged = [g for g in range(6) if buf.buckets[g].sharding.grads]
            assert bool(staged) == (strategy >= 2)
            for name, p in params.items():
                gid = buf.group_of(p)[0]
                assert (p.main_grad is None) == (gid in staged), (strategy, name)
            grads = [_grads(model, r) for r in range(world)]
            for gid in reversed(range(6)):  # backward order: launches as they complete
                gr.prepare(gid)
                for name in buf.groups[gid].names:
                    p = params[name]
                    assert p.main_grad.shape == p.shape and not p.main_grad.any()
                    p.main_grad.add_(grads[rank][name])
                    p.grad_added_to_main_grad = True
                    gr.mark_param_grad_ready(p)
                    if gid in staged and name == buf.groups[gid].names[-1]:
                        assert p.main_grad is None  # launched: a late write would be lost
            gr.finish()
            for name, p in params.items():
                assert (p.main_grad is None) == (buf.group_of(p)[0] in staged), name
                got, rows = _reduced(buf, name)
                want = _expect(grads, name, rows, lambda r, n: True)
                torch.testing.assert_close(got, want, msg=lambda m, n=name: f"{n}: {m}")
            buf.zero_grad_buffer()
            assert all((p.main_grad is None) == (buf.group_of(p)[0] in staged)
                       for p in params.values())  # fmt: skip
    return rank


def _late_while_in_flight(strategy):
    """``MAIN_GRAD`` staging: a gradient that comes while its bucket's reduction is
    still in flight (a shared weight's second use, a fused wgrad writing late) waits for
    that reduction, is staged afresh and reduced at the end of backward. It used to
    race the collective reading the staging bucket in place, or be freed with it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _, buf = _setup(strategy, grad_staging="main_grad")
    gr = GradReducePipeline(buf)  # one reduction in flight
    params = dict(model.named_parameters())
    for gid in range(len(buf.buckets)):
        gr.prepare(gid)
    for name in ("vit.weight", "vit.bias", "blocks.3.lin.weight", "blocks.3.lin.bias"):
        params[name].grad = torch.full_like(params[name], 2.0)
        gr.accumulate(params[name])
    gr.mark_bucket_ready(5)
    gr.mark_bucket_ready(4)  # waits for bucket 5's reduction: bucket 4's is in flight
    assert [g for g, _w, _p in gr._inflight] == [4]
    late = params["blocks.3.lin.weight"]
    if rank == 0:
        late.grad = torch.full_like(late, 100.0)
        gr.accumulate(late)

    gr.finish(agree=_agree)
    got, _ = _reduced(buf, "blocks.3.lin.weight")
    assert torch.all(got == 2.0 + 100.0 / world), got.unique()
    got, _ = _reduced(buf, "blocks.3.lin.bias")
    assert torch.all(got == 2.0), got.unique()
    return rank


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_main_grad_gradient_during_its_reduction(strategy):
    assert run_distributed(_late_while_in_flight, 2, args=(strategy,), timeout=60) == [0, 1]


def test_main_grad_protocol_under_every_strategy():
    assert run_distributed(_main_grad_protocol, 2, timeout=60) == [0, 1]


def test_all_gather_pipeline():
    assert run_distributed(_all_gather_pipeline, 2) == [0, 1]


def test_grad_reduce_pipeline_order_and_inflight_limit():
    assert run_distributed(_grad_reduce_pipeline, 2) == [0, 1]


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_grad_never_arriving_on_one_rank_and_late_grads(strategy):
    assert run_distributed(_unused_on_one_rank, 2, args=(strategy,), timeout=60) == [0, 1]


def test_double_buffer():
    assert run_distributed(_double_buffer, 2) == [0, 1]
