"""``CommContext`` (Note [streams and frees]): no streams and no-op orders on CPU, the
order of a bucket's gather, copy-out, reads and frees as a ``StreamRecorder`` logs it,
the recorder's rules failing on what breaks them, and the context not replaced while a
gather is in flight. On CUDA: the launch runs on the gather stream, which waited on
compute (the rest is the GPU check's)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_mesh
from fsdp_buffers import AllGatherPipeline, ParamAndGradBuffer
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
            [*_REDUCE, _FOLLOW_UP, ("wait_event", COMPUTE, 0, "", REDUCE), ("read", COMPUTE, 0, "main grads", REDUCE, REDUCE)],
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
