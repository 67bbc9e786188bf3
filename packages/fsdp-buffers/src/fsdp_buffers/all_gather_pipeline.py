"""``AllGatherPipeline``: gathers buckets ahead of use and releases them after.

Each bucket moves EMPTY → GATHER_IN_PROGRESS → READY_TO_USE → EMPTY (``BucketStatus``,
owned by the ``Bucket``; Note [bucket states]). A bucket whose model weights are
replicated (``fsdp_no_shard``, or a strategy below 3) is READY_TO_USE from the start
and issues a collective only when an optimizer step left it STALE (Note [stale
buckets]). This pipeline decides when: prefetch walks the forward (or backward) order
of buckets past the ones asked for and starts gathering those that are EMPTY (or
STALE), while the unsharded bytes it has started stay within
``prefetch_budget_bytes``: by default ``prefetch_depth`` (1; FSDP2's
``set_modules_to_forward_prefetch`` analogue, 0 turns prefetch off) times the largest
communication unit's unsharded bytes (an FSDP unit, or the units coalesced into one,
``ParameterGroup.coalesced_unit_ids``), so with units of equal size ``prefetch_depth``
units are gathered ahead of the one in use. Every rank makes the same calls in the
same order, so collectives match across ranks.

The forward order is the buckets' registration order, unless given. With
``follow_observed_order`` (the hook layer turns it on) the pipeline records the order in
which buckets are asked for with forward prefetch during a forward, and
``commit_observed_order`` (called at the end of the root forward) makes it the order
that the following backward and the next forward prefetch in, as FSDP2 does with its
post-forward order: a model that runs its units in another order than it registers them
prefetches the unit that actually comes next. Buckets not asked for keep their relative
order after those that were. The backward order is the reverse, without the buckets
that the forward reported no backward will ask for (``record_backward``: a frozen unit run
with autograd on whose outputs need no gradient), so that a backward never prefetches a
unit it does not run. Two counters tell how well prefetch guessed:
``wasted_prefetches``, buckets gathered by prefetch and released without being asked
for, and ``prefetch_misses``, buckets asked for (with prefetch on) that no prefetch had
started: with the right order, one per pass (the first unit of a forward, of a
backward).

Note [stale buckets]. Under ZeRO-1/2 the compute weights are replicated and the main
weights sharded, so installing an optimizer step is one all-gather per bucket. With
``overlap_param_gather`` the step leaves those buckets STALE instead (``fsdp_hooks``
chooses which: ``mark_stale``), and this pipeline gathers them as it gathers ZeRO-3's
EMPTY buckets: the root buckets at the root pre-forward, each unit's at its
pre-forward, with forward prefetch, so the all-gathers overlap forward compute as
FSDP2's do; what no unit asked for is gathered at the root post-forward
(``land_stale``), so nothing is stale or in flight after a forward. Release keeps what
they gathered (the compute weights are replicated). Unlike EMPTY buckets, stale ones
are gathered in one fixed order on every rank, whatever the units a rank runs (a unit
skipped on one rank only issues no collective under ZeRO-1/2 otherwise): the root
buckets, then the others in registration order. Starting a stale bucket's gather first
starts and waits for every stale bucket before it in that order, so the same sequence
of collectives is issued on every rank; a model that runs its units out of
registration order only loses overlap. A write to a unit's main weights inside the
forward after its gather started is not in that forward's compute weights (as a write
to a ZeRO-3 unit's shard after its prefetch is not); the next root pre-forward sees it
by the version counters and installs again (``fsdp_hooks``' ParamState).

With ``fsdp_double_buffer`` two units cannot hold one slot: prefetch stops at a bucket
whose slot is taken, and a bucket asked for whose slot is held by buckets that were
only prefetched (units that ran in another order, or were skipped) evicts them; they
are gathered again when asked for. A slot held by a bucket asked for is an error.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from itertools import islice

from fsdp_buffers.bucket import BucketStatus
from fsdp_buffers.collectives import describe_bucket
from fsdp_buffers.param_and_grad_buffer import ParamAndGradBuffer

__all__ = ["AllGatherPipeline", "BucketStatus", "PrefetchOrder"]


class PrefetchOrder(enum.Enum):
    FORWARD_PASS_ORDER = 0
    BACKWARD_PASS_ORDER = 1


class AllGatherPipeline:
    def __init__(
        self,
        buffer: ParamAndGradBuffer,
        *,
        prefetch_budget_bytes: int | None = None,
        forward_order: Sequence[int] | None = None,
        follow_observed_order: bool = False,
        prefetch_depth: int = 1,
    ) -> None:
        if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int):
            raise TypeError(f"prefetch_depth must be an int >= 0; got {prefetch_depth!r}")
        if prefetch_depth < 0:
            raise ValueError(
                f"prefetch_depth must be >= 0 (0: no prefetch, 1: one unit ahead); "
                f"got {prefetch_depth}"
            )
        self.prefetch_depth = prefetch_depth
        self.buffer = buffer
        self.buckets = buffer.buckets
        n = len(self.buckets)
        self._set_forward_order(list(range(n)) if forward_order is None else list(forward_order))
        self.follow_observed_order = follow_observed_order
        self._observed: list[int] = []
        self._observed_set: set[int] = set()
        self._no_backward: set[int] = set()
        self._backward: set[int] = set()
        if prefetch_budget_bytes is None:
            # prefetch_depth communication units ahead: that many times the largest
            # one's unsharded bytes (coalesced units share their fsdp_unit_id).
            per_unit: dict[object, int] = {}
            for b in self.buckets:
                key = b.group.fsdp_unit_id if b.group.fsdp_unit_id is not None else ("b", b.gid)
                if b.is_distributed or b.can_be_stale:
                    per_unit[key] = per_unit.get(key, 0) + b.unsharded_bytes
            prefetch_budget_bytes = prefetch_depth * max(per_unit.values(), default=0)
        self.prefetch_budget_bytes = prefetch_budget_bytes
        self._what = [describe_bucket(buffer, g, "all-gather") for g in range(n)]
        self._asked: set[int] = set()  # gathered because asked for, not only prefetched
        self.wasted_prefetches = 0
        self.prefetch_misses = 0
        # Note [stale buckets]: the order stale buckets are gathered in, and how far
        # it has been walked (no bucket before ``_stale_next`` is STALE, unless marked
        # since: ``reset`` rewinds it, and the wrapper resets before each install).
        roots = buffer.root_groups
        self._stale_order = [
            g
            for g in [*roots, *(g for g in range(n) if g not in roots)]
            if self.buckets[g].can_be_stale
        ]
        self._stale_position = {g: i for i, g in enumerate(self._stale_order)}
        self._stale_next = 0
        self.reset()

    def _set_forward_order(self, order: list[int], no_backward: set[int] | None = None) -> None:
        n = len(self.buckets)
        if sorted(order) != list(range(n)):
            raise ValueError(
                f"forward_order must be a permutation of the {n} bucket ids; got {order}"
            )
        self.forward_order = order
        skip = self._skip = no_backward or set()
        self._sequence = {
            PrefetchOrder.FORWARD_PASS_ORDER: order,
            PrefetchOrder.BACKWARD_PASS_ORDER: [g for g in order[::-1] if g not in skip],
        }
        self._position = {
            kind: {g: i for i, g in enumerate(seq)} for kind, seq in self._sequence.items()
        }
        # A bucket asked for in backward but left out of its sequence prefetches nothing.
        backward = self._position[PrefetchOrder.BACKWARD_PASS_ORDER]
        for g in skip:
            backward[g] = len(self._sequence[PrefetchOrder.BACKWARD_PASS_ORDER])
        # The same, picked by identity on each prefetch (an Enum hashes in Python).
        self._forward_seq = (order, self._position[PrefetchOrder.FORWARD_PASS_ORDER])
        self._backward_seq = (self._sequence[PrefetchOrder.BACKWARD_PASS_ORDER], backward)

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    @property
    def status(self) -> list[BucketStatus]:
        """Each bucket's ``BucketStatus`` (owned by the bucket)."""
        return [b.status for b in self.buckets]

    def is_distributed(self, gid: int) -> bool:
        return self.buckets[gid].is_distributed

    def reset(self) -> None:
        """Release every gathered bucket; replicated buckets are kept (a gather of one
        in flight lands), and STALE ones stay STALE."""
        for gid in range(len(self.buckets)):
            self.release_bucket(gid)
        self._stale_next = 0

    def record_backward(self, bucket_ids: Iterable[int], expected: bool) -> None:
        """During a forward: whether a backward will ask for these buckets. Those that
        no call of the forward expects a backward for are left out of the backward
        prefetch order committed next."""
        (self._backward if expected else self._no_backward).update(bucket_ids)

    def commit_observed_order(self) -> None:
        """End of a forward: prefetch from now on in the order buckets were asked for
        in it (with ``follow_observed_order``); see the module note."""
        observed, self._observed, self._observed_set = self._observed, [], set()
        skip = self._no_backward - self._backward
        self._no_backward, self._backward = set(), set()
        if not self.follow_observed_order or not observed:
            return
        seen = set(observed)
        order = observed + [g for g in self.forward_order if g not in seen]
        if order != self.forward_order or skip != self._skip:  # else nothing to rebuild
            self._set_forward_order(order, skip)

    def async_bucket_gather(self, gid: int) -> None:
        bucket = self.buckets[gid]
        if bucket.status is BucketStatus.STALE:
            self._start_stale(gid)
            return
        if bucket.status is not BucketStatus.EMPTY:
            return
        if not bucket.can_gather():
            for other in self.gathered_buckets():
                if other not in self._asked and bucket.blocked_by(self.buckets[other]):
                    self.release_bucket(other)
        bucket.start_gather()

    def _start_stale(self, gid: int) -> None:
        """Start stale bucket ``gid``'s gather, after starting and waiting for every
        stale bucket before it in the stale order (Note [stale buckets])."""
        order, buckets = self._stale_order, self.buckets
        target = self._stale_position[gid]
        if target < self._stale_next:  # marked stale since the walk passed it
            self._stale_next = 0
        while self._stale_next <= target:
            other = order[self._stale_next]
            self._stale_next += 1
            bucket = buckets[other]
            if bucket.status is BucketStatus.STALE:
                bucket.start_gather()
                if other != gid:
                    bucket.wait_gather(self._what[other])

    def land_stale(self) -> None:
        """Gather every STALE bucket and wait for every gather of a replicated bucket in
        flight, in the stale order: afterwards every compute weight is current. The
        root post-forward calls it, and so does anything else that reads compute
        weights outside the forward's gathers (Note [stale buckets])."""
        buckets = self.buckets
        for gid in self._stale_order:
            bucket = buckets[gid]
            if bucket.status is not BucketStatus.READY_TO_USE:
                if bucket.status is BucketStatus.STALE:
                    self._start_stale(gid)
                bucket.wait_gather(self._what[gid])

    def wait_bucket_ready(self, gid: int) -> None:
        self._asked.add(gid)
        self.async_bucket_gather(gid)  # if EMPTY: evicts prefetched slot holders first
        self.buckets[gid].wait_gather(self._what[gid])

    def all_gather_params(
        self,
        bucket_ids: Iterable[int],
        *,
        prefetch: bool = True,
        prefetch_order: PrefetchOrder = PrefetchOrder.FORWARD_PASS_ORDER,
        wait_bucket_ready: bool = True,
    ) -> None:
        """Start gathering ``bucket_ids`` (in the given order), prefetch what follows
        them in ``prefetch_order``, and wait for ``bucket_ids`` unless told not to."""
        ids = bucket_ids if type(bucket_ids) is list else list(bucket_ids)
        if not ids:
            return
        self._asked.update(ids)  # asked for: no prefetch below may evict them
        buckets = self.buckets
        for gid in ids:
            status = buckets[gid].status
            if status is BucketStatus.EMPTY or status is BucketStatus.STALE:
                if prefetch:
                    self.prefetch_misses += 1
                self.async_bucket_gather(gid)
        if prefetch:
            if prefetch_order is PrefetchOrder.FORWARD_PASS_ORDER:
                seen = self._observed_set
                for gid in ids:
                    if gid not in seen:
                        seen.add(gid)
                        self._observed.append(gid)
            self._prefetch(ids, prefetch_order)
        if wait_bucket_ready:
            for gid in ids:
                # READY_TO_USE has nothing in flight (the second unit of a coalesced
                # group, a replicated bucket): no call to wait on it.
                if buckets[gid].status is not BucketStatus.READY_TO_USE:
                    self.wait_bucket_ready(gid)

    def gather_for_immediate_use(self, gid: int) -> None:
        """Gather ``gid`` and wait, for a read that ends before the next gather (a weight
        unpacked for one autograd node). It stays evictable, as a prefetched bucket is:
        a double-buffer slot it holds can go to the next bucket asked for."""
        asked = gid in self._asked
        self.wait_bucket_ready(gid)
        if not asked:
            self._asked.discard(gid)

    def _prefetch(self, ids: list[int], order: PrefetchOrder) -> None:
        forward = order is PrefetchOrder.FORWARD_PASS_ORDER
        sequence, position = self._forward_seq if forward else self._backward_seq
        budget = self.prefetch_budget_bytes
        used = 0
        buckets = self.buckets
        for gid in islice(sequence, max(map(position.__getitem__, ids)) + 1, None):
            bucket = buckets[gid]
            status = bucket.status
            if not bucket.is_distributed and status is BucketStatus.READY_TO_USE:
                continue  # replicated and current: nothing to gather, nothing held
            size = bucket.unsharded_bytes
            if status is BucketStatus.EMPTY or status is BucketStatus.STALE:
                if used + size > budget or not bucket.can_gather():
                    break
                self.async_bucket_gather(gid)
            used += size
            if used >= budget:
                break

    def release_bucket(self, gid: int) -> None:
        """Free a gathered bucket's memory; a gather still in flight is finished first
        (its output buffer is in use by the collective)."""
        bucket = self.buckets[gid]
        if not bucket.is_distributed:
            if bucket.status is BucketStatus.GATHER_IN_PROGRESS:
                bucket.release(self._what[gid])  # a stale bucket's gather: landed, kept
            return
        if (
            bucket.status is BucketStatus.EMPTY
            and not bucket.group.model_weight_buffer.has_unsharded_data  # type: ignore[union-attr]
        ):
            # Already released (most buckets at each reset): nothing in flight (EMPTY
            # has no pending gather) and nothing to free.
            self._asked.discard(gid)
            return
        if bucket.status is not BucketStatus.EMPTY and gid not in self._asked:
            self.wasted_prefetches += 1
        bucket.release(self._what[gid])
        self._asked.discard(gid)

    def gathered_buckets(self) -> list[int]:
        return [
            b.gid for b in self.buckets if b.is_distributed and b.status is not BucketStatus.EMPTY
        ]
