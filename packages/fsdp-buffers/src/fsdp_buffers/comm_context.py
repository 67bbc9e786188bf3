"""``CommContext``: which stream each collective runs on, and the order between them.

FSDP2's ``FSDPCommContext`` in our terms: one per ``ParamAndGradBuffer``, shared by its
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
  the optimizer step). Copy-outs and the follow-ups of reductions run here, as in FSDP2.
- GATHER: the unit all-gathers. ``launch(GATHER)`` first orders it after COMPUTE (what
  the collective reads, the local shard, and the memory it writes were last written or
  read there: an optimizer step, an install, a released bucket), then issues the
  collective with GATHER current, so the communicator's stream waits GATHER, not the
  compute queued after the launch: a prefetched gather overlaps the unit computing
  meanwhile. FSDP2 orders its all-gather streams after compute once per forward (root
  pre-forward); this layer cannot see a root forward and orders them at each launch,
  which keeps the same overlap for a gather issued one unit ahead (the compute it waits
  for is what was queued before the unit that prefetches it).
- REDUCE: the reductions (reduce-scatter, all-reduce, the outer reduction of hybrid
  sharding: their communicators have their own streams already, so the outer reduction
  overlaps the next shard-group one without a third stream). ``launch(REDUCE)`` orders it
  after COMPUTE first: a reduction reads gradients only after the compute that wrote them.

Reading a collective's result: COMPUTE waits on the collective itself (``wait``: the
work's ``wait()`` with COMPUTE current makes that stream wait on the communicator's, and
on gloo blocks the host), before any read of the result (a copy-out, the model's use of
a gathered bucket, the accumulation of a reduced shard, the optimizer).

Freeing: memory allocated on one stream and read on another is freed only after the
allocating stream has waited on an event recorded on the reading stream after its last
read (``free``). The caching allocator hands a freed block to the next allocation on the
stream that made it, at once, in host order; without the wait, the next gather could
write a block that a copy-out queued on COMPUTE has not read yet. FSDP2 does the same
with its copy-out event and ``wait_all_gather_streams_on_event``; events rather than
``record_stream``, whose delay of the reuse depends on when the allocator next looks.
Gather outputs are allocated on GATHER (a rank-major bucket gathered in place, or the
rank-major output copied out to a parameter-major bucket, which is allocated on COMPUTE
at copy-out and freed there). Reductions' inputs and outputs are allocated on COMPUTE
and read by the communicator; COMPUTE waits on the collective before they are dropped
(``PendingCollective`` keeps them until then). While every launch orders GATHER after
COMPUTE, a later gather would be ordered after the reads anyway; the free's own wait is
what keeps frees right if launches are ordered less often (FSDP2's once per forward),
and costs one event per free. The watch of ``test_no_free_in_flight`` checks the host
side of the same rule: no storage is shrunk while an unwaited collective uses it.
"""

from __future__ import annotations

import contextlib
import enum
from contextlib import AbstractContextManager
from typing import Any

import torch

from fsdp_buffers.collectives import PendingCollective

__all__ = ["CommContext", "DeviceStreams", "StreamKind", "StreamOps"]


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
        """COMPUTE (the current stream) waits on the collective ``pending`` launched on
        ``kind``'s stream, and runs its follow-up; before any read of its result."""
        self.note("wait", StreamKind.COMPUTE, gid, peer=kind)
        pending.wait(what)

    def free(self, allocated_on: StreamKind, used_by: StreamKind, gid: int, what: str) -> None:
        """Before memory allocated on ``allocated_on`` and used on ``used_by`` is freed.
        Allocated on a communication stream and read on COMPUTE: that stream waits on an
        event recorded on COMPUTE now (after the reads). Allocated on COMPUTE and used by
        a collective: COMPUTE already waited on it (``wait``); nothing to add."""
        if not self.has_streams:
            return
        if allocated_on is not used_by and allocated_on is not StreamKind.COMPUTE:
            ops = self.ops
            ops.wait_event(self._streams[allocated_on], ops.record(ops.current()))
            ops.note("wait_event", allocated_on, gid, peer=used_by)
        self.note("free", allocated_on, gid, what, used_by)
