"""The process's asynchronous saver: at most one save in flight, written by one
background thread, and the handle ``save_checkpoint(..., asynchronous=True)`` returns.

Note [asynchronous save]

``save_checkpoint(..., asynchronous=True)`` does in the caller's thread everything
that needs the training state or the default process group, and in one background
thread everything that only needs the files:

* foreground (every rank, in the call): the previous save is waited for and its
  failure raised (the next call raises it, on every rank alike); the ranks' paths and
  modes are compared and rank 0 prepares ``.<name>.incomplete`` (collectives on the
  default group, as a synchronous save); the state dict is built (an optimizer state
  owned by another rank is broadcast here); this rank's shards are copied into the
  saver's host buffers (``staging``), the extra dict and RNG states pickled. The call
  returns then: training may change every live tensor.
* background (one thread per process): the extra file and DCP's shard files are
  written from the copy, each rank checksums its files, rank 0 writes the manifest and
  publishes (``atomic``), exactly as a synchronous save does (one function,
  ``checkpoint._write_and_publish``).

The background part needs collectives: DCP gathers the ranks' plans and results, and
the ranks agree on every error and on the checksums. They run on a process group of
their own, a gloo group created (collectively, on every rank in the same order) by the
first asynchronous save, never on the default group: the training loop issues its own
collectives on the default group from the main thread meanwhile, and two threads
issuing collectives on one group interleave differently on different ranks (a
deadlock, or one rank's checksum list received as another's gradient bucket). gloo
because it needs no device (the copy is on the host) and no stream; one group because
the saves of one process are serialised, so every rank issues the same sequence of
collectives on it. Doing the agreement in the foreground at ``wait()`` instead would
make the publish wait for the training loop to call ``wait()``, leaving the new
checkpoint unpublished for as long as the user does not ask.

Every background error is agreed among the ranks before the thread ends (as in a
synchronous save), so each rank's handle holds the same error, naming the rank that
found it; ``wait()`` raises it, and so does the next save or load (its first act is to
wait for the one in flight). A rank killed during the background part leaves
``.<name>.incomplete`` without a manifest, or the previous checkpoint at ``.<name>.old``
between the two renames: the previous checkpoint stays loadable (``atomic``), and the
surviving ranks' background collectives fail or time out (the group's timeout, as the
default group's for a synchronous save).

Call ``wait()`` on the last handle before ``dist.destroy_process_group()``: the
background collectives need the group. At interpreter exit a save in flight is
finished first (the thread is joined), as long as the process group is still there.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist

from fsdp_ckpt import _dist
from fsdp_ckpt.errors import CheckpointError
from fsdp_ckpt.staging import HostStager

__all__ = ["AsyncSaver", "SaveHandle", "process_saver"]

_SINGLE_PROCESS_SAVE = (
    "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to save"
)


class SaveHandle:
    """An asynchronous save in flight (``save_checkpoint(..., asynchronous=True)``).

    ``blocked_s``: seconds the call kept the caller (waiting for the previous save,
    the checks, the copy into host memory); ``staging_bytes``: the host memory its
    copy holds (kept for the next save)."""

    def __init__(
        self, path: Path, future: Future[Path], blocked_s: float, staging_bytes: int
    ) -> None:
        self.path = path
        self.blocked_s = blocked_s
        self.staging_bytes = staging_bytes
        self._future = future

    def done(self) -> bool:
        """Whether the background part has finished (published, or failed)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Path:
        """Block until the checkpoint is published and return its path; raise its
        failure (a ``CheckpointError`` naming the rank, the same on every rank) if it
        failed, and ``TimeoutError`` if ``timeout`` seconds pass first."""
        try:
            return self._future.result(timeout)
        except TimeoutError as exc:
            raise TimeoutError(
                f"the asynchronous save to {self.path} is still being written after {timeout} s"
            ) from exc

    def __repr__(self) -> str:
        state = "in flight" if not self.done() else "finished"
        return f"SaveHandle({str(self.path)!r}, {state}, blocked {self.blocked_s:.3f} s)"


class AsyncSaver:
    """One per process (``process_saver``): the background thread, its process group,
    the host staging buffers, and the save in flight."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp-ckpt-save")
        self._group: dist.ProcessGroup | None = None
        self._group_of: object | None = None  # the default group it was made under
        self._in_flight: SaveHandle | None = None
        self.stager = HostStager()

    def group(self) -> dist.ProcessGroup | None:
        """The background saves' gloo group (see the Note), None in one process. A
        collective the first time (and after the default group is replaced): every
        rank calls it at the same point."""
        if not _dist.is_distributed():
            return None
        world = dist.group.WORLD
        if self._group is None or self._group_of is not world:
            self._group = dist.new_group(backend="gloo")
            self._group_of = world
        return self._group

    def busy(self) -> bool:
        return self._in_flight is not None and not self._in_flight.done()

    @property
    def in_flight(self) -> SaveHandle | None:
        return self._in_flight

    def drain(self) -> None:
        """Wait for the save in flight; raise its failure (the same on every rank)."""
        handle, self._in_flight = self._in_flight, None
        if handle is None:
            return
        try:
            handle.wait()
        except Exception as exc:
            raise CheckpointError(
                f"the previous asynchronous save, to {handle.path}, failed, so it was not "
                f"published (a checkpoint saved there before stays): {exc}"
            ) from exc

    def submit(self, path: Path, write: Callable[[], Path], started: float) -> SaveHandle:
        """Run ``write`` in the background; the handle, its blocked time counted from
        ``started`` (``time.perf_counter()``)."""
        if self.busy():
            raise AssertionError("submit() while a save is in flight: drain() first")
        # DCP warns on every save in one process; the synchronous save silences it with
        # catch_warnings, which is not thread-safe, so here it is filtered for good
        # (only this message: one process is intended).
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_SAVE)
        future = self._executor.submit(write)
        handle = SaveHandle(path, future, time.perf_counter() - started, self.stager.nbytes)
        self._in_flight = handle
        return handle


_SAVER: AsyncSaver | None = None
_SAVER_LOCK = threading.Lock()


def process_saver() -> AsyncSaver:
    """This process's ``AsyncSaver``, created on first use."""
    global _SAVER
    with _SAVER_LOCK:
        if _SAVER is None:
            _SAVER = AsyncSaver()
        return _SAVER
