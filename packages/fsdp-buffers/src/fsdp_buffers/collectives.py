"""Asynchronous collectives, the streams they run on, and their accounting: one code path
for gloo and NCCL.

Every collective is issued with ``async_op=True`` and returns a ``PendingCollective``
whose ``wait()`` runs the follow-up work exactly once: ``complete`` (the wait, then the
follow-up: accumulate) and ``close`` (the frees). On NCCL the collective already runs on
the communicator's own stream, ordered after the work the current stream had queued
when it was issued, and the wait makes the current stream wait for it; on gloo it runs
on gloo's threads and the wait blocks the host. The tensors a collective uses are
referenced by the pending object until it is closed, so the caching allocator cannot
hand their memory to anyone else early.

``CommStats`` counts what was issued: the number of collectives, the unsharded
elements and bytes they covered, and the per-rank traffic of a ring algorithm
(``(N-1)/N`` of the buffer for all-gather and reduce-scatter, twice that for
all-reduce), which is what DESIGN.md's bound ``3·Ψ·(N−1)/N`` counts.

``CommContext`` says which stream each collective runs on, and the order between them:
FSDP2's ``FSDPCommContext`` in our terms, one per ``ParamAndGradBuffer``, shared by its
buckets (``BucketContext.comm``). On CUDA it holds an all-gather stream and a
reduce stream next to the compute stream (whatever stream is current when a bucket
verb runs); on any other device (CPU, gloo) there are no streams and every method
only does what the host order already guarantees: nothing. Callers have one code path.

The stream operations are a ``StreamOps`` given to the context (``DeviceStreams`` on
CUDA, the null ``StreamOps`` elsewhere); a test gives a recording one
(``fsdp_buffers.stream_recorder.StreamRecorder``) that logs each operation with its stream and
bucket, so the ordering rules below are checked on CPU.

Note [streams and frees]. Three streams, named by ``StreamKind``:

- COMPUTE: the current stream when a bucket verb runs (the model's forward, backward and
  the optimizer step). Copy-outs of gathers, and the copy-ins of reductions (packing
  gradients into the collective's input, casts), run here, as in FSDP2.
- GATHER: the unit all-gathers. ``launch(GATHER)`` first orders it after COMPUTE (what
  the collective reads, the local shard, and the memory it writes were last written or
  read there: an optimizer step, an install, a released bucket), then issues the
  collective with GATHER current, so the communicator's stream waits GATHER, not the
  compute queued after the launch: a prefetched gather overlaps the unit computing
  meanwhile. FSDP2 orders its all-gather streams after compute once per forward (root
  pre-forward); this layer cannot see a root forward and orders them at each launch,
  which keeps the same overlap for a gather issued one unit ahead (the compute it waits
  for is what was queued before the unit that prefetches it).
- REDUCE: the reductions (reduce-scatter, all-reduce, and hybrid sharding's outer ones,
  which run after every shard-group one was waited for) and, as on FSDP2's
  reduce-scatter stream, the pre-divide (``grad_scale``, inside the launch) and the
  follow-up (adopting the output as the main-grad shard, or adding it in).
  ``launch(REDUCE)`` orders it after COMPUTE first: a reduction reads gradients only
  after the compute that wrote them (the copy-in).

Reading a result: for a gather, COMPUTE waits on the collective (``wait``: the work's
``wait()`` with COMPUTE current; on gloo it blocks the host) before any read of it. For
a reduction, ``wait`` makes REDUCE wait on the collective and queues the follow-up
there, then COMPUTE waits on an event recorded after the follow-up, before it reads or
writes those main grads (a later gradient, a rebase, the optimizer, ``zero_grad``) and
before the reduction's memory is freed. The host keeps its schedule; only the kernels
move, so the add and the scale overlap compute. FSDP2 frees each reduction's input at
a later post-backward and waits on its ``post_reduce_event`` at the end of backward;
here COMPUTE waits when the host drops the reduction.

Freeing: memory allocated on one stream and used on another is freed only after the
allocating stream has waited on an event recorded on the using stream after its last
use (``free``; for a reduction, ``wait``'s event): the caching allocator hands a freed
block to the next allocation on the stream that made it at once, in host order. FSDP2
does the same (its copy-out event, ``wait_all_gather_streams_on_event``); events, not
``record_stream``, whose delay of the reuse, and so the peak, depends on when the
allocator next looks. Gather outputs are allocated on GATHER (the parameter-major bucket
a copy-out fills on COMPUTE). Everything a reduction uses or leaves is allocated on
COMPUTE: its input and output, the staging bucket it reads in place, the main-grad
shard the follow-up adopts (a cast copy is made at the launch); a follow-up allocates
only temporaries it frees itself. ``PendingCollective`` drops the input and output, and
frees the staging bucket (``release``), only after COMPUTE's wait on that event. While
every launch orders GATHER after COMPUTE a later gather is ordered after the reads
anyway; the free's own wait keeps frees right if launches are ordered less often
(FSDP2's once per forward), for one event per free. ``test_no_free_in_flight`` checks
the host side: no storage is shrunk while an unwaited collective uses it.
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d

from fsdp_buffers.profiling import annotate

__all__ = [
    "COLLECTIVE_TIMEOUT_ENV",
    "CollectiveError",
    "CollectiveKind",
    "CommContext",
    "CommStats",
    "DeviceStreams",
    "PendingCollective",
    "StreamKind",
    "StreamOps",
    "all_gather",
    "all_gather_uneven",
    "all_reduce",
    "describe_bucket",
    "read_timeout_env",
    "reduce_scatter",
    "wait_with_timeout",
]

COLLECTIVE_TIMEOUT_ENV = "FSDP_COLLECTIVE_TIMEOUT_S"


class CollectiveError(RuntimeError):
    """A collective that failed or timed out, named by what it was for."""


# ``FSDP_COLLECTIVE_TIMEOUT_S`` as read at import and at each wrap (``read_timeout_env``):
# an environment lookup per wait cost more than some small collectives' copies.
_timeout_s: list[str | None] = [os.environ.get(COLLECTIVE_TIMEOUT_ENV)]


def read_timeout_env() -> None:
    """Read ``FSDP_COLLECTIVE_TIMEOUT_S`` again (each wrap calls this)."""
    _timeout_s[0] = os.environ.get(COLLECTIVE_TIMEOUT_ENV)


def wait_with_timeout(work: dist.Work, what: str) -> None:
    """``work.wait()``, turning a failure into a ``CollectiveError`` naming ``what``.

    Without ``FSDP_COLLECTIVE_TIMEOUT_S`` the process group's own timeout applies
    (``init_process_group(timeout=...)``: gloo raises then; NCCL's watchdog aborts the
    process). With it, the host waits at most that many seconds (on NCCL this makes
    the wait block the host: a debugging aid). The variable is read at import and
    whenever a model is wrapped."""
    seconds = _timeout_s[0]
    try:
        if seconds:
            work.wait(timedelta(seconds=float(seconds)))
        else:
            work.wait()
    except Exception as err:
        raise _collective_error(what, seconds, err) from err


def _collective_error(what: str, seconds: str | None, err: Exception) -> CollectiveError:
    limit = f" within {COLLECTIVE_TIMEOUT_ENV}={seconds}s" if seconds else ""
    return CollectiveError(
        f"{what} did not complete{limit}: {err}. A rank that stopped, or runs a different "
        "schedule (a unit skipped or called on some ranks only), leaves the others waiting; "
        "FSDP_CHECK_SCHEDULE=1 names the unit, rank and step where ranks diverged"
    )


class CollectiveKind(enum.Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"


@dataclass
class CollectiveCount:
    calls: int = 0
    numel: int = 0  # unsharded elements covered
    bytes: int = 0  # unsharded bytes covered
    traffic_bytes: float = 0.0  # bytes each rank sends with a ring algorithm
    # Of ``bytes``, those of padding: the shards' tails no parameter fills (a whole
    # placement's imbalance, Note [whole placement]; a row layout's rounding).
    padding_bytes: int = 0


@dataclass
class CommStats:
    """What this rank issued since the last ``reset()``, by kind of collective."""

    counts: dict[CollectiveKind, CollectiveCount] = field(
        default_factory=lambda: {k: CollectiveCount() for k in CollectiveKind}
    )

    def record(
        self,
        kind: CollectiveKind,
        numel: int,
        element_size: int,
        group_size: int,
        padding_numel: int = 0,
    ) -> None:
        c = self.counts[kind]
        c.calls += 1
        c.numel += numel
        c.bytes += numel * element_size
        c.padding_bytes += padding_numel * element_size
        ring = (group_size - 1) / group_size if group_size > 0 else 0.0
        factor = 2.0 if kind is CollectiveKind.ALL_REDUCE else 1.0
        c.traffic_bytes += factor * ring * numel * element_size

    def reset(self) -> None:
        for c in self.counts.values():
            c.calls = c.numel = c.bytes = c.padding_bytes = 0
            c.traffic_bytes = 0.0

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {k.value: dict(vars(c)) for k, c in self.counts.items()}

    def __getitem__(self, kind: CollectiveKind) -> CollectiveCount:
        return self.counts[kind]


class PendingCollective:
    """A collective in flight and the work to do once it has finished: ``then``, the
    follow-up that reads its result (accumulate), and ``release``, what frees memory the
    collective or the follow-up used (run once that memory is free to reuse; see
    Note [streams and frees])."""

    __slots__ = ("_done", "_release", "_then", "_work", "keepalive")

    def __init__(
        self,
        work: dist.Work | None,
        then: Callable[[], None] | None = None,
        keepalive: tuple[torch.Tensor, ...] = (),
        release: Callable[[], None] | None = None,
    ) -> None:
        self._work = work
        self._then = then
        self._release = release
        self._done = False
        self.keepalive = keepalive

    def wait(self, what: str = "a collective") -> None:
        """``complete`` then ``close``: on one stream."""
        self.complete(what)
        self.close()

    def complete(self, what: str = "a collective") -> None:
        """Wait on the collective (the current stream waits on NCCL; the host blocks on
        gloo) and run its follow-up, once."""
        if self._done:
            return
        self._done = True
        with _WAIT_RANGE:  # the wait and the follow-up (accumulate)
            work = self._work
            if work is not None:
                if _timeout_s[0] is None:
                    try:  # wait_with_timeout's common case inline: one call fewer
                        work.wait()
                    except Exception as err:
                        raise _collective_error(what, None, err) from err
                else:
                    wait_with_timeout(work, what)
            self._work = None
            if self._then is not None:
                then, self._then = self._then, None
                then()

    def close(self) -> None:
        """Free what the collective and its follow-up used (``release``, the
        ``keepalive`` tensors), once it is ``complete``."""
        if self._release is not None:
            release, self._release = self._release, None
            release()
        self.keepalive = ()

    @property
    def done(self) -> bool:
        return self._done


def describe_bucket(buffer, gid: int, kind: str) -> str:  # buffer: ParamAndGradBuffer
    """``kind`` of bucket ``gid``, named by its FSDP unit and first parameters (for errors)."""
    group = buffer.groups[gid]
    unit = group.fsdp_unit_id
    where = f"unit {buffer.unit_names[unit]!r}" if unit is not None else "outside every unit"
    names = ", ".join(group.names[:3]) + (", ..." if len(group.names) > 3 else "")
    return f"the {kind} of bucket {gid} ({where}: {names})"


# Profiler ranges made once: callers pass theirs (one object per label, made at wrap).
_WAIT_RANGE = annotate("fsdp.wait")
_ALL_GATHER_RANGE = annotate("fsdp.all_gather")
_REDUCE_SCATTER_RANGE = annotate("fsdp.reduce_scatter")
_ALL_REDUCE_RANGE = annotate("fsdp.all_reduce")


# Note [direct collectives]
# torch.distributed's functions (``all_gather_into_tensor`` ...) check their arguments,
# look the group up, handle complex tensors, torch-function modes and a coalescing
# context in Python, then call the process group's own method: about ten Python calls per
# collective, as much host time as the rest of a small bucket's step. Our buffers are
# real, plain, contiguous tensors on a group this rank belongs to, so the hot path calls
# the group's method itself, with options made once. Anything else takes torch's
# function: no group object, a coalescing context a caller opened, a complex tensor, a
# subclass or torch-function mode, and a torch.distributed function someone replaced (a
# test or tool observing collectives keeps seeing ours). Backends see the same call
# either way, and so do tools below Python (the process group's methods, the
# dispatcher, flight recorder): NCCL and gloo keep one path.
_PG = dist.ProcessGroup
# Looked up on the group at each call (a profiler or counter may wrap the class's).
_AG = "all_gather_single" if hasattr(_PG, "all_gather_single") else "_allgather_base"
_RS = "reduce_scatter_single" if hasattr(_PG, "reduce_scatter_single") else "_reduce_scatter_base"
_RED_OP = dist.ReduceOp.RedOpType  # SUM, AVG ...: not a premultiplied sum's object
_AG_OPTS = _c10d.AllgatherOptions()
_AG_OPTS.asyncOp = True


def _options_by_op(kind: type) -> dict[dist.ReduceOp.RedOpType, Any]:
    """Options of ``kind`` for each plain reduce op (a bare PREMUL_SUM has no factor:
    torch's function takes it)."""
    made: dict[dist.ReduceOp.RedOpType, Any] = {}
    for op in _RED_OP.__members__.values():
        if op != _RED_OP.PREMUL_SUM:
            opts = made[op] = kind()
            opts.reduceOp = op
            opts.asyncOp = True
    return made


_RS_OPTS = _options_by_op(_c10d.ReduceScatterOptions)
_AR_OPTS = _options_by_op(_c10d.AllreduceOptions)


_WORLD = getattr(_c10d, "_world", None)  # a coalescing context's groups
_has_torch_function = torch._C._has_torch_function  # a subclass or a torch-function mode
_TORCH_ALL_GATHER = _c10d.all_gather_into_tensor  # torch's own, to tell a replaced one
_TORCH_REDUCE_SCATTER = _c10d.reduce_scatter_tensor
_TORCH_ALL_REDUCE = _c10d.all_reduce


def _direct(group: dist.ProcessGroup | None, a: torch.Tensor, b: torch.Tensor) -> bool:
    if type(group) is not _PG or _WORLD is None or _has_torch_function((a, b)):
        return False
    return group not in _WORLD.pg_coalesce_state and not (a.is_complex() or b.is_complex())


# The group's size for ``CommStats`` is asked of the group itself when it is one (a C++
# call): get_world_size's Python lookups cost more than some small collectives' copies.


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    label: annotate = _ALL_GATHER_RANGE,
    padding: float = 0.0,
) -> dist.Work:
    """``padding``: the fraction of ``output`` that is padding (for ``stats``)."""
    with label:
        if stats is not None:
            numel = output.numel()
            stats.record(
                CollectiveKind.ALL_GATHER,
                numel,
                output.element_size(),
                group.size() if type(group) is _PG else dist.get_world_size(group),
                round(numel * padding),
            )
        if dist.all_gather_into_tensor is _TORCH_ALL_GATHER and _direct(group, output, shard):
            return getattr(group, _AG)(output, shard, _AG_OPTS)  # Note [direct collectives]
        return dist.all_gather_into_tensor(output, shard, group=group, async_op=True)


def reduce_scatter(
    output: torch.Tensor,
    unsharded: torch.Tensor,
    group: dist.ProcessGroup | None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    stats: CommStats | None = None,
    label: annotate = _REDUCE_SCATTER_RANGE,
    padding: float = 0.0,
) -> dist.Work:
    """``padding``: the fraction of ``unsharded`` that is padding (for ``stats``)."""
    with label:
        if stats is not None:
            stats.record(
                CollectiveKind.REDUCE_SCATTER,
                unsharded.numel(),
                unsharded.element_size(),
                group.size() if type(group) is _PG else dist.get_world_size(group),
                round(unsharded.numel() * padding),
            )
        if (
            dist.reduce_scatter_tensor is _TORCH_REDUCE_SCATTER
            and type(op) is _RED_OP
            and op in _RS_OPTS
            and _direct(group, output, unsharded)
        ):  # Note [direct collectives]
            return getattr(group, _RS)(output, unsharded, _RS_OPTS[op])
        return dist.reduce_scatter_tensor(output, unsharded, op=op, group=group, async_op=True)


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    stats: CommStats | None = None,
    label: annotate = _ALL_REDUCE_RANGE,
) -> dist.Work:
    with label:
        if stats is not None:
            stats.record(
                CollectiveKind.ALL_REDUCE,
                tensor.numel(),
                tensor.element_size(),
                group.size() if type(group) is _PG else dist.get_world_size(group),
            )
        if (
            dist.all_reduce is _TORCH_ALL_REDUCE
            and type(op) is _RED_OP
            and op in _AR_OPTS
            and _direct(group, tensor, tensor)
        ):  # Note [direct collectives]
            return group.allreduce([tensor], _AR_OPTS[op])  # type: ignore[union-attr]
        return dist.all_reduce(tensor, op=op, group=group, async_op=True)


def all_gather_uneven(
    local: torch.Tensor,
    dim: int,
    ranges: Sequence[tuple[int, int]],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """The whole tensor from uneven pieces: rank ``k`` of ``group`` holds ``ranges[k]``
    (``[start, end)`` along ``dim``, not necessarily in rank order). One all-gather
    padded to the widest piece (collectives need equal sizes), joined in tensor order.
    Blocking and uncounted: for checkpoints and full parameters, not the step."""
    width = max(end - start for start, end in ranges)
    shape = list(local.shape)
    shape[dim] = width
    with annotate("fsdp.all_gather_uneven"):
        padded = local.new_zeros(shape)
        padded.narrow(dim, 0, local.shape[dim]).copy_(local)
        out = [torch.empty_like(padded) for _ in ranges]
        dist.all_gather(out, padded, group=group)
        order = sorted(range(len(ranges)), key=lambda k: ranges[k])
        parts = [out[k].narrow(dim, 0, ranges[k][1] - ranges[k][0]) for k in order]
        return torch.cat(parts, dim)


class StreamKind(enum.Enum):
    """The streams of Note [streams and frees]."""

    COMPUTE = "compute"
    GATHER = "gather"
    REDUCE = "reduce"


_NULL = contextlib.nullcontext()


class StreamOps:
    """How streams are made and ordered: this base is the null implementation (no
    streams; the host's order is the only order). ``DeviceStreams`` is CUDA's; a test's
    recorder logs the calls instead. ``note`` receives what the context does with each
    bucket (for a recorder; the others ignore it): ``op`` on ``stream`` for bucket
    ``gid``; ``what`` names the memory, ``peer`` the other stream (the one waited on,
    or the one that used the memory freed)."""

    has_streams = False

    def make(self, kind: StreamKind) -> Any:
        return kind

    def current(self) -> Any:
        return StreamKind.COMPUTE

    def use(self, stream: Any) -> AbstractContextManager[Any]:
        return _NULL

    def record(self, stream: Any) -> Any:
        return None

    def wait_event(self, stream: Any, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any, other: Any) -> None:
        pass

    def note(
        self, op: str, stream: StreamKind, gid: int, what: str = "", peer: StreamKind | None = None
    ) -> None:
        pass


class DeviceStreams(StreamOps):
    """CUDA streams and events, made as FSDP2 makes them (high priority, so copies
    and launches on them are not queued behind compute kernels)."""

    has_streams = True

    def __init__(self, device: torch.device, priority: int = -1) -> None:
        self.device = device
        self.priority = priority
        self._module = torch.get_device_module(device.type)

    def make(self, kind: StreamKind) -> Any:
        return self._module.Stream(device=self.device, priority=self.priority)

    def current(self) -> Any:
        return self._module.current_stream(self.device)

    def use(self, stream: Any) -> AbstractContextManager[Any]:
        return self._module.stream(stream)

    def record(self, stream: Any) -> Any:
        return stream.record_event()

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)


def default_stream_ops(device: torch.device) -> StreamOps:
    """``DeviceStreams`` on CUDA, the null ``StreamOps`` on any other device."""
    return DeviceStreams(device) if device.type == "cuda" else StreamOps()


class CommContext:
    """The streams of one ``ParamAndGradBuffer`` and the orders of Note [streams and
    frees]. With the null ``StreamOps`` every method is a no-op (``wait`` still waits on
    the collective, as the host must)."""

    def __init__(self, device: torch.device, ops: StreamOps | None = None) -> None:
        self.device = device
        self.ops = ops if ops is not None else default_stream_ops(device)
        self.has_streams = self.ops.has_streams
        self._streams = (
            {k: self.ops.make(k) for k in (StreamKind.GATHER, StreamKind.REDUCE)}
            if self.has_streams
            else {}
        )
        self.note = self.ops.note

    def stream(self, kind: StreamKind) -> Any:
        """The stream of ``kind`` (the current one for COMPUTE); None without streams."""
        if not self.has_streams:
            return None
        return self.ops.current() if kind is StreamKind.COMPUTE else self._streams[kind]

    def launch(self, kind: StreamKind, gid: int) -> AbstractContextManager[Any]:
        """Around a collective's launch (and the allocation of what it writes, when
        that belongs to ``kind``): ``kind``'s stream waits on COMPUTE, then is current."""
        if not self.has_streams:
            return _NULL
        ops, stream = self.ops, self._streams[kind]
        ops.wait_stream(stream, ops.current())
        ops.note("wait_stream", kind, gid, peer=StreamKind.COMPUTE)
        ops.note("launch", kind, gid)
        return ops.use(stream)

    def wait(self, pending: PendingCollective, what: str, kind: StreamKind, gid: int) -> None:
        """Wait on the collective ``pending`` launched on ``kind``'s stream, run its
        follow-up and free what it used (Note [streams and frees]). A gather: COMPUTE
        (the current stream) waits on it, before any read of its result. A reduction:
        the reduce stream waits on it and runs the follow-up (the accumulation into the
        main grads), then COMPUTE waits on an event recorded after that, before the
        memory they used (allocated on COMPUTE) is freed and before anything on COMPUTE
        touches the main grads. Without streams the host waits (gloo), then the follow-up
        and the frees run."""
        if not self.has_streams:
            pending.wait(what)
            return
        if kind is not StreamKind.REDUCE:
            self.note("wait", StreamKind.COMPUTE, gid, peer=kind)
            pending.wait(what)
            return
        ops, stream = self.ops, self._streams[kind]
        with ops.use(stream):
            self.note("wait", kind, gid, peer=kind)
            pending.complete(what)
            event = ops.record(stream)
        ops.wait_event(ops.current(), event)
        self.note("wait_event", StreamKind.COMPUTE, gid, peer=kind)
        self.free(StreamKind.COMPUTE, kind, gid, "reduction input and output")
        pending.close()

    def free(self, allocated_on: StreamKind, used_by: StreamKind, gid: int, what: str) -> None:
        """Before memory allocated on ``allocated_on`` and used on ``used_by`` is freed.
        Allocated on a communication stream and read on COMPUTE: that stream waits on an
        event recorded on COMPUTE now (after the reads). Allocated on COMPUTE and used by
        a collective (and a reduction's follow-up): COMPUTE already waited on it, or on
        the event after the follow-up (``wait``); nothing to add."""
        if not self.has_streams:
            return
        if allocated_on is not used_by and allocated_on is not StreamKind.COMPUTE:
            ops = self.ops
            ops.wait_event(self._streams[allocated_on], ops.record(ops.current()))
            ops.note("wait_event", allocated_on, gid, peer=used_by)
        self.note("free", allocated_on, gid, what, used_by)
