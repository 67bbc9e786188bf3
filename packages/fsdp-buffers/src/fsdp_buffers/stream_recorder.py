"""``StreamRecorder``: a ``StreamOps`` that logs, for checking Note [streams and frees]
on a machine without streams.

Give it to a buffer (``buffer.comm = CommContext(buffer.device, StreamRecorder())``) and
train: every stream operation the context makes and what it does with each bucket is
logged as an ``Op`` (symbolic streams: the ``StreamKind``), and ``check()`` raises on the
first operation that breaks a rule:

- a read of a bucket's gathered data on COMPUTE (a copy-out, the model's use) before
  COMPUTE waited on that bucket's latest gather;
- a reduction's wait (and so its follow-up) made anywhere but on the REDUCE stream with
  REDUCE current; a read or write on COMPUTE of what reductions' follow-ups write (the
  main grads, a staging bucket a reduction holds: ``peer`` REDUCE) while a reduction of
  that bucket is launched and COMPUTE has not waited on an event recorded on REDUCE
  after its follow-up;
- a free of memory allocated on a communication stream before that stream waited on
  COMPUTE after COMPUTE's last read of it; of memory allocated on COMPUTE that a gather
  used before COMPUTE waited on that gather; of a reduction's memory (allocated on
  COMPUTE) before COMPUTE waited on the event after its follow-up;
- a launch on a communication stream not preceded by that stream waiting on COMPUTE;
- a read, write or free made while a communication stream is current (inside a
  ``launch`` or a follow-up): COMPUTE must be current, or the wrong stream orders it.

The collectives themselves run for real (gloo); only the stream calls are recorded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fsdp_buffers.collectives import StreamKind, StreamOps

__all__ = ["Op", "StreamRecorder"]

_COMPUTE = StreamKind.COMPUTE
_REDUCE = StreamKind.REDUCE


@dataclass(frozen=True)
class Op:
    """One logged operation: ``op`` on ``stream`` for bucket ``gid``; ``what`` names
    the memory read or freed, ``peer`` the other stream (the one waited on, or the one
    that used the memory freed), ``on`` the stream current when it was made."""

    op: str
    stream: StreamKind
    gid: int
    what: str = ""
    peer: StreamKind | None = None
    on: StreamKind = _COMPUTE


class StreamRecorder(StreamOps):
    has_streams = True

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self._current: list[StreamKind] = [_COMPUTE]

    def note(
        self, op: str, stream: StreamKind, gid: int, what: str = "", peer: StreamKind | None = None
    ) -> None:
        self.ops.append(Op(op, stream, gid, what, peer, self._current[-1]))

    # Streams are their kinds; the orders are the notes the context makes with them.
    def make(self, kind: StreamKind) -> Any:
        return kind

    def current(self) -> Any:
        return self._current[-1]

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()

    def count(self, op: str, stream: StreamKind | None = None) -> int:
        return sum(1 for o in self.ops if o.op == op and (stream is None or o.stream is stream))

    def check(self) -> None:
        """Raise ``AssertionError`` naming the first operation that breaks a rule."""
        # Per (stream, bucket): whether COMPUTE waited on the latest gather launched.
        waited: dict[tuple[StreamKind, int], bool] = {}
        # Per bucket, its reductions oldest first: "launched", then "followed" (the
        # reduce stream waited on it and ran its follow-up), then "waited" (compute
        # waited on an event recorded after that); dropped when their memory is freed.
        reductions: dict[int, list[str]] = {}
        ordered_at: dict[StreamKind, int] = {}  # stream -> index it last waited on COMPUTE
        last_read: dict[int, int] = {}  # bucket -> index of COMPUTE's last read
        for i, o in enumerate(self.ops):
            where = f"operation {i} {o}"
            if o.op in ("read", "write", "free") and o.on is not _COMPUTE:
                raise AssertionError(f"{where}: made while {o.on.value} was current, not compute")
            if o.op == "wait" and o.on is not o.stream:
                raise AssertionError(
                    f"{where}: made while {o.on.value} was current, not {o.stream.value}"
                )
            if o.op in ("wait_stream", "wait_event"):
                if o.peer is _COMPUTE:
                    ordered_at[o.stream] = i
                elif o.stream is _COMPUTE and o.peer is _REDUCE:
                    # An event on the reduce stream: after every follow-up queued there.
                    for states in reductions.values():
                        states[:] = ["waited" if s == "followed" else s for s in states]
            elif o.op == "launch":
                before = self.ops[i - 1] if i else None
                if before != Op("wait_stream", o.stream, o.gid, peer=_COMPUTE):
                    raise AssertionError(f"{where}: launched before its stream waited on compute")
                if o.stream is _REDUCE:
                    reductions.setdefault(o.gid, []).append("launched")
                else:
                    waited[(o.stream, o.gid)] = False
            elif o.op == "wait":
                assert o.peer is not None, where
                if o.peer is not _REDUCE:
                    waited[(o.peer, o.gid)] = True
                    continue
                if o.stream is not _REDUCE:
                    raise AssertionError(
                        f"{where}: a reduction's follow-up runs on the reduce stream, not "
                        f"{o.stream.value}"
                    )
                states = reductions.get(o.gid, [])
                if "launched" not in states:
                    raise AssertionError(f"{where}: waited on a reduction never launched")
                states[states.index("launched")] = "followed"
            elif o.op in ("read", "write"):
                if o.peer is _REDUCE:  # what a reduction's follow-up writes
                    if any(s != "waited" for s in reductions.get(o.gid, ())):
                        raise AssertionError(
                            f"{where}: {o.op} before compute waited on the follow-up of the "
                            "reduction in flight"
                        )
                elif not waited.get((StreamKind.GATHER, o.gid), True):
                    raise AssertionError(f"{where}: {o.op} before compute waited on its gather")
                else:
                    last_read[o.gid] = i
            elif o.op == "free":
                if o.peer is None or o.peer is o.stream:
                    continue  # used where it was allocated: the stream's own order
                if o.stream is _COMPUTE and o.peer is _REDUCE:  # the oldest reduction's
                    states = reductions.get(o.gid, [])
                    state = states.pop(0) if states else "waited"
                    if state == "launched":
                        raise AssertionError(
                            f"{where}: freed before the reduce stream waited on the "
                            "collective using it"
                        )
                    if state == "followed":
                        raise AssertionError(
                            f"{where}: freed before compute waited on the follow-up of the "
                            "reduction using it"
                        )
                elif o.stream is _COMPUTE:  # used by a collective on ``peer``
                    if not waited.get((o.peer, o.gid), True):
                        raise AssertionError(
                            f"{where}: freed before compute waited on the {o.peer.value} "
                            "collective using it"
                        )
                elif ordered_at.get(o.stream, -1) < last_read.get(o.gid, -1):
                    raise AssertionError(
                        f"{where}: freed before {o.stream.value} waited on compute's last read"
                    )
                elif not waited.get((o.stream, o.gid), True):
                    raise AssertionError(f"{where}: freed under its unwaited collective")
