"""``AllGatherPipeline``: gathers buckets ahead of use and releases them after.

A bucket moves EMPTY → GATHER_IN_PROGRESS → READY_TO_USE → EMPTY. A bucket whose model
weights are replicated (``fsdp_no_shard``, or a strategy below 3) is READY_TO_USE from
the start and never issues a collective. Prefetch walks the forward (or backward)
order of buckets past the ones asked for and starts gathering those that are EMPTY,
while the unsharded bytes it has started stay within ``prefetch_budget_bytes``. Every
rank makes the same calls in the same order, so collectives match across ranks.

With ``fsdp_double_buffer`` two units cannot hold one slot: prefetch stops at a bucket
whose slot is taken, and a bucket asked for whose slot is held by buckets that were
only prefetched (units that ran in another order, or were skipped) evicts them; they
are gathered again when asked for. A slot held by a bucket asked for is an error.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

from fsdp_buffers.collectives import PendingCollective, describe_bucket
from fsdp_buffers.param_and_grad_buffer import ParamAndGradBuffer

__all__ = ["AllGatherPipeline", "BucketStatus", "PrefetchOrder"]


class BucketStatus(enum.Enum):
    EMPTY = enum.auto()
    GATHER_IN_PROGRESS = enum.auto()
    READY_TO_USE = enum.auto()


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
    ) -> None:
        self.buffer = buffer
        n = buffer.num_buckets
        self.forward_order = list(range(n)) if forward_order is None else list(forward_order)
        if sorted(self.forward_order) != list(range(n)):
            raise ValueError(
                f"forward_order must be a permutation of the {n} bucket ids; "
                f"got {self.forward_order}"
            )
        self._position = {
            PrefetchOrder.FORWARD_PASS_ORDER: {g: i for i, g in enumerate(self.forward_order)},
            PrefetchOrder.BACKWARD_PASS_ORDER: {
                g: i for i, g in enumerate(reversed(self.forward_order))
            },
        }
        self._distributed = [
            g.model_weight_buffer is not None and g.model_weight_buffer.is_data_distributed
            for g in buffer.groups
        ]
        if prefetch_budget_bytes is None:
            # One FSDP unit ahead: the largest unit's unsharded bytes.
            per_unit: dict[object, int] = {}
            for gid, group in enumerate(buffer.groups):
                key = group.fsdp_unit_id if group.fsdp_unit_id is not None else ("bucket", gid)
                if self._distributed[gid]:
                    per_unit[key] = per_unit.get(key, 0) + buffer.unsharded_bytes(gid)
            prefetch_budget_bytes = max(per_unit.values(), default=0)
        self.prefetch_budget_bytes = prefetch_budget_bytes
        self.status = [BucketStatus.EMPTY] * n
        self._what = [describe_bucket(buffer, g, "all-gather") for g in range(n)]
        self._pending: dict[int, PendingCollective] = {}
        self._asked: set[int] = set()  # gathered because asked for, not only prefetched
        self.reset()

    @property
    def num_buckets(self) -> int:
        return self.buffer.num_buckets

    def is_distributed(self, gid: int) -> bool:
        return self._distributed[gid]

    def reset(self) -> None:
        """Release every gathered bucket; replicated buckets stay READY_TO_USE."""
        for gid in range(self.num_buckets):
            if self._distributed[gid]:
                self.release_bucket(gid)
            else:
                self.status[gid] = BucketStatus.READY_TO_USE

    def async_bucket_gather(self, gid: int) -> None:
        if self.status[gid] is not BucketStatus.EMPTY:
            return
        if not self.buffer.can_gather(gid):
            for other in self.gathered_buckets():
                if other not in self._asked and self.buffer.gather_blocked_by(gid, other):
                    self.release_bucket(other)
        pending = self.buffer.start_param_gather(gid)
        if pending is None:  # replicated: nothing to gather
            self.status[gid] = BucketStatus.READY_TO_USE
            return
        self._pending[gid] = pending
        self.status[gid] = BucketStatus.GATHER_IN_PROGRESS

    def wait_bucket_ready(self, gid: int) -> None:
        self._asked.add(gid)
        if self.status[gid] is BucketStatus.EMPTY:
            self.async_bucket_gather(gid)
        pending = self._pending.pop(gid, None)
        if pending is not None:
            pending.wait(self._what[gid])
        self.status[gid] = BucketStatus.READY_TO_USE

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
        ids = list(bucket_ids)
        self._asked.update(ids)
        for gid in ids:
            self.async_bucket_gather(gid)
        if prefetch and ids:
            self._prefetch(ids, prefetch_order)
        if wait_bucket_ready:
            for gid in ids:
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
        position = self._position[order]
        sequence = (
            self.forward_order
            if order is PrefetchOrder.FORWARD_PASS_ORDER
            else self.forward_order[::-1]
        )
        budget = self.prefetch_budget_bytes
        used = 0
        for gid in sequence[max(position[g] for g in ids) + 1 :]:
            if not self._distributed[gid]:
                continue
            size = self.buffer.unsharded_bytes(gid)
            if self.status[gid] is BucketStatus.EMPTY:
                if used + size > budget or not self.buffer.can_gather(gid):
                    break
                self.async_bucket_gather(gid)
            used += size
            if used >= budget:
                break

    def release_bucket(self, gid: int) -> None:
        """Free a gathered bucket's memory; a gather still in flight is finished first
        (its output buffer is in use by the collective)."""
        if not self._distributed[gid]:
            return
        pending = self._pending.pop(gid, None)
        if pending is not None:
            pending.wait(self._what[gid])
        self.buffer.release_param_bucket(gid)
        self.status[gid] = BucketStatus.EMPTY
        self._asked.discard(gid)

    def gathered_buckets(self) -> list[int]:
        return [
            g
            for g in range(self.num_buckets)
            if self._distributed[g] and self.status[g] is not BucketStatus.EMPTY
        ]
