"""``CommContext`` (Note [streams and frees]): no streams and no-op orders on CPU, the
order of a bucket's gather, copy-out, reads and frees as a ``StreamRecorder`` logs it,
a reduction's pre-divide and follow-up on the reduce stream with compute waiting on the
follow-up's event before frees and main-grad reads, the recorder's rules failing on what
breaks them, and the context not replaced while a gather is in flight. On CUDA: the
launch runs on the gather stream, which waited on compute, and compute waits for a
follow-up on the reduce stream (the rest is the GPU check's)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_mesh
from fsdp_buffers import (
    AllGatherPipeline,
    GradReducePipeline,
    MixedPrecisionPolicy,
    ParamAndGradBuffer,
)
from fsdp_buffers.collectives import (
    CommContext,
    DeviceStreams,
    PendingCollective,
    StreamKind,
    StreamOps,
)
from fsdp_buffers.stream_recorder import Op, StreamRecorder
from fsdp_mesh.testing import run_distributed

COMPUTE, GATHER, REDUCE = StreamKind.COMPUTE, StreamKind.GATHER, StreamKind.REDUCE


def test_cpu_has_no_streams_and_every_order_is_a_no_op():
    comm = CommContext(torch.device("cpu"))
    assert type(comm.ops) is StreamOps and not comm.has_streams
    assert comm.stream(GATHER) is None and comm.stream(COMPUTE) is None
    with comm.launch(GATHER, 0):
        x = torch.ones(3)
    comm.free(GATHER, COMPUTE, 0, "x")
    ran = []
    comm.wait(PendingCollective(None, lambda: ran.append(1)), "nothing", GATHER, 0)
    assert ran == [1] and x.sum().item() == 3
    # A reduction: the follow-up, then what it frees, then its tensors are dropped.
    pending = PendingCollective(
        None, lambda: ran.append(2), keepalive=(x,), release=lambda: ran.append(3)
    )
    comm.wait(pending, "nothing", REDUCE, 0)
    assert ran == [1, 2, 3] and pending.done and pending.keepalive == ()


def _log(*ops: tuple) -> StreamRecorder:
    rec = StreamRecorder()
    rec.ops = [Op(*o) for o in ops]
    return rec


_LAUNCH = [("wait_stream", GATHER, 0, "", COMPUTE), ("launch", GATHER, 0)]
_REDUCE = [("wait_stream", REDUCE, 0, "", COMPUTE), ("launch", REDUCE, 0)]
_FOLLOW_UP = ("wait", REDUCE, 0, "", REDUCE, REDUCE)
_GOOD = [
    *_LAUNCH,
    ("wait", COMPUTE, 0, "", GATHER),
    ("read", COMPUTE, 0, "gather output"),
    ("wait_event", GATHER, 0, "", COMPUTE),
    ("free", GATHER, 0, "gather output", COMPUTE),
    ("read", COMPUTE, 0, "gathered bucket"),
    ("free", COMPUTE, 0, "gathered bucket", COMPUTE),
    *_REDUCE,
    ("wait", REDUCE, 0, "", REDUCE, REDUCE),  # the follow-up, on the reduce stream
    ("wait_event", COMPUTE, 0, "", REDUCE),
    ("free", COMPUTE, 0, "reduction input", REDUCE),
    ("read", COMPUTE, 0, "main grads", REDUCE),
    ("write", COMPUTE, 0, "gradients", REDUCE),
]


@pytest.mark.parametrize(
    ("ops", "message"),
    [
        ([*_LAUNCH, ("read", COMPUTE, 0, "x")], "read before compute waited on its gather"),
        (
            [
                *_LAUNCH,
                ("wait", COMPUTE, 0, "", GATHER),
                ("read", COMPUTE, 0, "x"),
                ("free", GATHER, 0, "x", COMPUTE),
            ],
            "freed before gather waited on compute's last read",
        ),
        (
            [*_REDUCE, ("free", COMPUTE, 0, "x", REDUCE)],
            "freed before the reduce stream waited on the collective using it",
        ),
        (  # the reduce stream still reads it (the follow-up)
            [*_REDUCE, _FOLLOW_UP, ("free", COMPUTE, 0, "x", REDUCE)],
            "freed before compute waited on the follow-up of the reduction using it",
        ),
        (  # the old order: compute waits on the collective and runs the follow-up
            [*_REDUCE, ("wait", COMPUTE, 0, "", REDUCE)],
            "a reduction's follow-up runs on the reduce stream, not compute",
        ),
        (
            [*_REDUCE, ("wait", REDUCE, 0, "", REDUCE)],
            "made while compute was current, not reduce",
        ),
        ([_FOLLOW_UP], "waited on a reduction never launched"),
        (
            [*_REDUCE, ("read", COMPUTE, 0, "main grads", REDUCE)],
            "read before compute waited on the follow-up of the reduction in flight",
        ),
        (  # compute waits on an event recorded before the follow-up was queued
            [
                *_REDUCE,
                ("wait_event", COMPUTE, 0, "", REDUCE),
                _FOLLOW_UP,
                ("write", COMPUTE, 0, "gradients", REDUCE),
            ],
            "write before compute waited on the follow-up of the reduction in flight",
        ),
        (  # two reductions of one bucket in flight: the second one's is not waited on
            [
                *_REDUCE,
                *_REDUCE,
                _FOLLOW_UP,
                ("wait_event", COMPUTE, 0, "", REDUCE),
                ("free", COMPUTE, 0, "x", REDUCE),
                ("write", COMPUTE, 0, "main grads", REDUCE),
            ],
            "write before compute waited on the follow-up of the reduction in flight",
        ),
        (
            [
                *_REDUCE,
                _FOLLOW_UP,
                ("wait_event", COMPUTE, 0, "", REDUCE),
                ("read", COMPUTE, 0, "main grads", REDUCE, REDUCE),
            ],
            "made while reduce was current, not compute",
        ),
        (
            [*_LAUNCH, ("wait_event", GATHER, 0, "", COMPUTE), ("free", GATHER, 0, "x", COMPUTE)],
            "freed under its unwaited collective",
        ),
        (
            [*_LAUNCH, ("wait", COMPUTE, 0, "", GATHER, GATHER)],
            "made while gather was current, not compute",
        ),
        ([("launch", REDUCE, 1)], "launched before its stream waited on compute"),
        (
            [("wait_stream", GATHER, 1, "", COMPUTE), ("launch", REDUCE, 1)],
            "launched before its stream waited on compute",
        ),
    ],
)
def test_the_recorder_fails_what_breaks_a_rule(ops, message):
    _log(*_GOOD).check()
    with pytest.raises(AssertionError, match=message):
        _log(*ops).check()


def test_the_recorder_knows_the_current_stream():
    """A wait nested inside a launch (the gather stream current) would make the gather
    stream, not compute, wait on the collective: the recorder logs where it was made."""
    rec = StreamRecorder()
    comm = CommContext(torch.device("cpu"), rec)
    with comm.launch(GATHER, 0):
        assert rec.current() is GATHER
        rec.note("wait", COMPUTE, 0, peer=GATHER)
    assert rec.current() is COMPUTE
    with pytest.raises(AssertionError, match="made while gather was current"):
        rec.check()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])


def _gather_and_release(double_buffer: bool) -> list[Op]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    index = fsdp_mesh.FSDPDistributedIndex(mesh, dp_shard_dim="dp")
    torch.manual_seed(0)
    model = Net()
    expected = [p.detach().clone() for p in model.parameters()]
    buf = ParamAndGradBuffer(
        model, index, strategy=3, fsdp_unit_modules=[Block], fsdp_double_buffer=double_buffer
    )
    rec = StreamRecorder()
    buf.comm = CommContext(buf.device, rec)
    pipe = AllGatherPipeline(buf)
    for gid in range(len(buf.buckets)):  # prefetches the next one
        pipe.all_gather_params([gid])
        pipe.release_bucket(gid)
    pipe.all_gather_params([0], prefetch=False, wait_bucket_ready=False)
    with pytest.raises(RuntimeError, match=r"gathers of buckets \[0\] are in flight"):
        buf.comm = CommContext(buf.device)
    pipe.reset()
    pipe.all_gather_params([0, 1], prefetch=False)  # two units: the two slots
    for p, e in zip(list(model.parameters())[:4], expected[:4], strict=True):
        assert torch.equal(p, e)
    pipe.reset()
    rec.check()
    return rec.ops


@pytest.mark.parametrize("double_buffer", [False, True])
def test_a_gather_is_waited_before_read_and_ordered_before_free(double_buffer):
    for ops in run_distributed(_gather_and_release, 2, args=(double_buffer,)):
        gids = sorted({o.gid for o in ops})
        assert gids == [0, 1, 2], gids
        for gid in gids:
            mine = [(o.op, o.stream, o.what, o.peer) for o in ops if o.gid == gid]
            launch = mine.index(("launch", GATHER, "", None))
            wait = mine.index(("wait", COMPUTE, "", GATHER))
            read = mine.index(("read", COMPUTE, "gathered bucket", None))
            assert mine[launch - 1] == ("wait_stream", GATHER, "", COMPUTE)
            assert launch < wait < read, mine
            freed = [i for i, m in enumerate(mine) if m[0] == "free"]
            assert freed and all(i > wait for i in freed), mine


class _Streams(TorchDispatchMode):
    """Logs each in-place op (a pre-divide, a follow-up's add or copy) with the stream
    current when it was queued and the storage it writes."""

    def __init__(self, rec: StreamRecorder) -> None:
        super().__init__()
        self.rec = rec
        self.log: list[tuple[str, StreamKind, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.endswith("_") and args and isinstance(args[0], torch.Tensor):
            self.log.append((name, self.rec.current(), args[0].untyped_storage().data_ptr()))
        return func(*args, **(kwargs or {}))


class _NoEventWait(CommContext):
    """Runs a reduction's follow-up on the reduce stream but lets compute go on without
    waiting on it (what the recorder must refuse)."""

    def wait(self, pending, what, kind, gid):
        if kind is not REDUCE:
            return super().wait(pending, what, kind, gid)
        with self.ops.use(self.stream(REDUCE)):
            self.note("wait", REDUCE, gid, peer=REDUCE)
            pending.complete(what)
        self.free(COMPUTE, REDUCE, gid, "reduction input and output")
        pending.close()


def _reduce(strategy: int, staging: str, comm_dtype, context=CommContext):
    """Two backwards' gradients reduced by a ``GradReducePipeline`` whose context logs to
    a ``StreamRecorder``: the logged orders, the streams of the in-place ops, and the
    reduced gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    index = fsdp_mesh.FSDPDistributedIndex(mesh, dp_shard_dim="dp")
    torch.manual_seed(0)
    model = Net()
    policy = MixedPrecisionPolicy(grad_comm_dtype=comm_dtype)
    buf = ParamAndGradBuffer(
        model,
        index,
        strategy=strategy,
        fsdp_unit_modules=[Block],
        mixed_precision_policy=policy,
        grad_staging=staging,
    )
    rec = StreamRecorder()
    buf.comm = context(buf.device, rec)
    pipe = GradReducePipeline(buf)
    params = dict(model.named_parameters())
    seeds = [torch.Generator().manual_seed(i) for i in range(2 * world)]
    grads = [{n: torch.randn(p.shape, generator=g) for n, p in params.items()} for g in seeds]
    mode = _Streams(rec)
    for k in range(2):
        for gid in range(len(buf.buckets)):
            pipe.prepare(gid)
        with mode:
            for name, p in params.items():
                p.grad = grads[rank * 2 + k][name].clone()
                pipe.mark_param_grad_ready(p)
            pipe.finish()
    main = [b.group.main_grad_buffer for b in buf.buckets]
    storages = {g.data.untyped_storage().data_ptr() for g in main}
    shards = [b.grads.main_grad_shard() for b in buf.buckets]
    rec.check()
    expected = {n: sum(g[n] for g in grads) / world for n in params}
    want = []
    for b, gbuf in zip(buf.buckets, main, strict=True):
        pm = torch.zeros(gbuf.layout.total_numel)
        for i, n in enumerate(b.group.names):
            gbuf.param_view(pm, i).copy_(expected[n])
        rm = torch.empty_like(pm)
        gbuf.layout.pack(pm, rm, gbuf.coarse)
        s = gbuf.layout.shard_numel
        want.append(rm[b.shard.rank * s : (b.shard.rank + 1) * s])
    return rec.ops, mode.log, storages, shards, want


@pytest.mark.parametrize(
    ("strategy", "staging", "comm_dtype"),
    [
        (0, "autograd", None),
        (1, "main_grad", None),
        (2, "autograd", torch.bfloat16),
        (3, "autograd", None),
        (3, "main_grad", None),
        (3, "main_grad", torch.bfloat16),
    ],
)
def test_a_reduction_is_scaled_and_followed_up_on_the_reduce_stream(strategy, staging, comm_dtype):
    """The pre-divide and the follow-up run on the reduce stream; compute waits on an
    event recorded after the follow-up before the reduction's memory is freed, and the
    recorder's rules hold; the main-grad shard is the mean of both backwards' sums."""
    for ops, log, storages, shards, want in run_distributed(
        _reduce, 2, args=(strategy, staging, comm_dtype)
    ):
        scales = [stream for name, stream, _ in log if name == "mul_"]
        assert scales and all(s is REDUCE for s in scales), log
        if strategy >= 2:  # sharded: only follow-ups write the main-grad shard
            writes = [(n, s) for n, s, ptr in log if ptr in storages]
            assert writes and all(s is REDUCE for _n, s in writes), writes
        for gid in sorted({o.gid for o in ops}):
            mine = [(o.op, o.stream, o.peer) for o in ops if o.gid == gid]
            launches = [i for i, m in enumerate(mine) if m == ("launch", REDUCE, None)]
            assert len(launches) == 2, mine
            for at in launches:
                follow = mine.index(("wait", REDUCE, REDUCE), at)
                assert mine[follow + 1] == ("wait_event", COMPUTE, REDUCE), mine
                assert mine[follow + 2] == ("free", COMPUTE, REDUCE), mine
        tol = {"atol": 2e-2, "rtol": 2e-2} if comm_dtype is not None else {}
        for got, expected in zip(shards, want, strict=True):
            torch.testing.assert_close(got, expected.to(got.dtype), **tol)


def _caught(strategy: int) -> str:
    try:
        _reduce(strategy, "autograd", None, _NoEventWait)
    except AssertionError as err:
        return str(err)
    return ""


@pytest.mark.parametrize("strategy", [0, 3])
def test_compute_going_on_without_the_follow_ups_event_is_caught(strategy):
    for message in run_distributed(_caught, 2, args=(strategy,)):
        assert "before compute waited on the follow-up of the reduction" in message, message


@pytest.mark.cuda  # runs under --fsdp-device cuda (scripts/gpu-check)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA streams")
def test_cuda_launch_runs_on_the_gather_stream_after_compute():
    device = torch.device("cuda", torch.cuda.current_device())
    comm = CommContext(device)
    assert isinstance(comm.ops, DeviceStreams) and comm.has_streams
    compute = torch.cuda.current_stream(device)
    gather = comm.stream(GATHER)
    assert gather != compute and comm.stream(REDUCE) not in (gather, compute)
    x = torch.ones(1 << 20, device=device)
    torch.cuda._sleep(10_000_000)  # compute busy: the gather stream must wait for it
    x.mul_(2)
    with comm.launch(GATHER, 0):
        assert torch.cuda.current_stream(device) == gather
        y = x * 3  # ordered after the mul_ on compute
    assert torch.cuda.current_stream(device) == compute
    comm.free(GATHER, COMPUTE, 0, "y")
    compute.wait_stream(gather)
    assert torch.equal(y, torch.full_like(x, 6.0))


@pytest.mark.cuda  # runs under --fsdp-device cuda (scripts/gpu-check)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA streams")
def test_cuda_follow_up_runs_on_the_reduce_stream_and_compute_waits_for_it():
    device = torch.device("cuda", torch.cuda.current_device())
    comm = CommContext(device)
    compute, reduce = torch.cuda.current_stream(device), comm.stream(REDUCE)
    main = torch.zeros(1 << 20, device=device)
    out = torch.ones(1 << 20, device=device)
    seen = []

    def follow_up() -> None:
        seen.append(torch.cuda.current_stream(device))
        torch.cuda._sleep(10_000_000)  # the reduce stream busy: compute must wait for it
        main.add_(out)

    comm.wait(PendingCollective(None, follow_up, keepalive=(out,)), "x", REDUCE, 0)
    assert seen == [reduce] and torch.cuda.current_stream(device) == compute
    main.mul_(2)  # queued on compute: after the add only if compute waited on its event
    assert torch.equal(main, torch.full_like(main, 2.0))
