"""``AllGatherPipeline``: gathers buckets ahead of use and releases them after.

Each bucket moves EMPTY → GATHER_IN_PROGRESS → READY_TO_USE → EMPTY (``BucketStatus``,
owned by the ``Bucket``; Note [bucket states]). A bucket whose model weights are
replicated (``fsdp_no_shard``, or a strategy below 3) is READY_TO_USE from the start
and never issues a collective. This pipeline decides when: prefetch walks the forward
(or backward) order of buckets past the ones asked for and starts gathering those that
are EMPTY, while the unsharded bytes it has started stay within
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
                if b.is_distributed:
                    per_unit[key] = per_unit.get(key, 0) + b.unsharded_bytes
            prefetch_budget_bytes = prefetch_depth * max(per_unit.values(), default=0)
        self.prefetch_budget_bytes = prefetch_budget_bytes
        self._what = [describe_bucket(buffer, g, "all-gather") for g in range(n)]
        self._asked: set[int] = set()  # gathered because asked for, not only prefetched
        self.wasted_prefetches = 0
        self.prefetch_misses = 0
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
        """Release every gathered bucket; replicated buckets stay READY_TO_USE."""
        for gid in range(self.num_buckets):
            self.release_bucket(gid)

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
        if bucket.status is not BucketStatus.EMPTY:
            return
        if not bucket.can_gather():
            for other in self.gathered_buckets():
                if other not in self._asked and bucket.blocked_by(self.buckets[other]):
                    self.release_bucket(other)
        bucket.start_gather()

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
            if buckets[gid].status is BucketStatus.EMPTY:
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
            if not bucket.is_distributed:
                continue
            size = bucket.unsharded_bytes
            if bucket.status is BucketStatus.EMPTY:
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
