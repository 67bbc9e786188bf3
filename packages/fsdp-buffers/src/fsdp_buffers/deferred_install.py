"""``DeferredInstalls``: ZeRO-1/2 weight all-gathers left to the next forward.

Note [deferred install]. Under ZeRO-1/2 the compute weights are replicated and the main
weights sharded, so installing an optimizer step is one all-gather per bucket. Waited
inside ``optimizer.step()`` those gathers overlap nothing; FSDP2 (which gathers in the
next forward) and Megatron's ``overlap_param_gather`` overlap them with forward compute.
With ``overlap_param_gather`` so does fsdp:

- The step queues the buckets whose install may wait (``Bucket.install_deferrable``,
  not root buckets: ``fsdp_hooks`` chooses) and issues nothing for them. Nothing is in
  flight between steps, so a user's own collectives, a checkpoint or the end of the
  program meet no pending work.
- The root pre-forward starts the first ``in_flight`` gathers; each unit's pre-forward
  lands the ones its buckets need and starts the next, so at most ``in_flight`` are in
  flight (each holds a rank-major copy of its bucket, as the synchronous install does),
  and the root post-forward lands the rest.
- Gathers are started and landed in one fixed order, the buckets' order, whatever the
  order the units run in: landing a bucket lands every bucket queued before it. So the
  collectives are the same sequence on every rank even when ranks run different units
  (a unit skipped on one rank); a model that runs its units out of registration order
  only loses overlap.
- Until its install lands, a bucket's parameter locations hold their DTensors (the main
  weights, already updated): a read outside the unit that lands it computes on the
  DTensor or raises, never on the stale compute weights.
- Main weights are written by users between steps (in-place ops on the DTensor
  parameters). ``ParamState`` recorded their versions when the step queued the
  installs, so the root pre-forward re-installs what users wrote before it (nothing is
  in flight then). A write after a bucket's gather started (inside the forward, before
  the unit that uses it) is seen when the gather lands, by the same version counters
  (``main_versions``), before anything is copied, and the bucket is installed again
  then, from what is there now (``Bucket.start_install``).
- Anything else that installs or overwrites the weights (``install_optimized_model_weights``,
  ``broadcast_params``) first lands what is in flight and forgets what is queued: it
  re-installs every bucket itself.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from fsdp_buffers.collectives import PendingCollective

if TYPE_CHECKING:
    from fsdp_buffers.bucket import Bucket

__all__ = ["DeferredInstalls"]


class DeferredInstalls:
    """The queue of deferred installs of one ``ParamAndGradBuffer`` (see the note)."""

    def __init__(self, buckets: Sequence[Bucket], in_flight: int = 2) -> None:
        if in_flight < 1:
            raise ValueError(f"in_flight must be >= 1; got {in_flight}")
        self._buckets = buckets
        self._in_flight = in_flight
        self._queued: deque[int] = deque()  # not started, in bucket order
        self._started: deque[tuple[int, PendingCollective | None]] = deque()
        # Buckets whose install has not landed: truthy while any is pending.
        self.pending: set[int] = set()
        # The version counters of a bucket's main weights as users write them, set by
        # the layer that hands those parameters out (``fsdp_hooks``' ParamState): a
        # gather whose bucket was written while in flight is done again when it lands.
        self.main_versions: Callable[[int], object] | None = None

    def queue(self, gids: Iterable[int]) -> None:
        """Queue the installs of ``gids`` (after ``forget``)."""
        self.forget()
        ordered = sorted(gids)
        self._queued.extend(ordered)
        self.pending.update(ordered)

    def start(self) -> None:
        """Start queued gathers until ``in_flight`` are in flight."""
        queued, started, buckets = self._queued, self._started, self._buckets
        if not queued or len(started) >= self._in_flight:
            return
        versions = self.main_versions
        with torch.no_grad():
            while queued and len(started) < self._in_flight:
                gid = queued.popleft()
                written = None
                if versions is not None:
                    written = functools.partial(_moved, versions, gid, versions(gid))
                started.append((gid, buckets[gid].start_install(True, written)))

    def land(self, gid: int) -> list[int]:
        """Land ``gid``'s install and every one queued before it; start the next ones.
        Returns the buckets landed, in order."""
        landed: list[int] = []
        pending = self.pending
        while gid in pending:
            if not self._started:
                self.start()
            landed.append(self._land_oldest())
        self.start()
        return landed

    def land_all(self) -> list[int]:
        """Land every pending install (starting the queued ones)."""
        return self.land(max(self.pending)) if self.pending else []

    def forget(self) -> None:
        """Land the gathers in flight and drop the queued ones (for a caller that
        installs every bucket again)."""
        while self._started:
            self._land_oldest()
        self._queued.clear()
        self.pending.clear()

    def _land_oldest(self) -> int:
        gid, started = self._started.popleft()
        self.pending.discard(gid)  # first: a failed wait raises, and is not retried
        if started is not None:
            with torch.no_grad():
                started.wait(f"the weight all-gather of bucket {gid} (deferred install)")
        return gid


def _moved(versions: Callable[[int], object], gid: int, sent: object) -> bool:
    return versions(gid) != sent
