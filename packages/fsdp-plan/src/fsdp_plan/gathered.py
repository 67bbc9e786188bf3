"""``gathered_peak``: the most bytes of gathered weights a rank holds at once in a step.

ZeRO-3: the real ``AllGatherPipeline`` (its prefetch budget, the double buffer's slots
and evictions) runs over the meta-device buffer on the fake process group, driven in
the order ``fsdp_hooks`` drives it (see its hooks note): the root buckets gathered
without prefetch and kept all step; each unit, in forward order, gathered with
forward prefetch and released after its forward; then, in reverse, gathered with
backward prefetch and released after its backward. Buckets that coalesced units share
(``suggested_communication_unit_size``) are released after the last unit sharing them
in each pass; the prefetch budget follows ``prefetch_depth``. Held bytes are read after each
gather is started (they only grow then): every sharded bucket's storage (0 when
released; a double-buffer slot in full, once) plus, for each gather still in flight
whose bucket is not rank-major, the rank-major copy its all-gather writes into
(``Bucket.start_gather``): a bucket asked for and the ones
prefetched after it have theirs at once.

ZeRO-1/2: after the optimizer step, ``install_optimized_model_weights`` all-gathers the
updated shards of every group whose main weights are sharded, two in flight at a time,
each into a rank-major copy unless the bucket is rank-major already. With
``overlap_param_gather`` the step leaves the groups that can be STALE so, and the real
``AllGatherPipeline`` replays the next forward's gathers of them (Note [stale buckets]):
the root buckets together at the root pre-forward, then each unit's with forward
prefetch; held bytes are the rank-major copies of the gathers in flight.
"""

from __future__ import annotations

from fsdp_buffers import (
    AllGatherPipeline,
    BucketStatus,
    ParamAndGradBuffer,
    PrefetchOrder,
    module_is_fully_no_shard,
)
from fsdp_hooks.runtime.backward import storage_key

__all__ = ["gathered_peak"]


def _rank_major_copy(buffer: ParamAndGradBuffer, gid: int) -> int:
    """Bytes of the rank-major copy an all-gather of bucket ``gid`` writes into (0 when
    the parameter-major bucket is rank-major already)."""
    mw = buffer.groups[gid].model_weight_buffer
    assert mw is not None
    return 0 if mw.layout.is_rank_major(mw.coarse) else buffer.buckets[gid].unsharded_bytes


def _units(buffer: ParamAndGradBuffer) -> list[tuple[int, list[int], list[int]]]:
    """Each hooked unit's (index, buckets to gather, buckets it releases), in forward
    order, as ``fsdp_hooks.runtime.hooks.FSDPHooks`` builds them."""
    roots = set(buffer.root_groups)
    out = []
    for index, name in enumerate(buffer.unit_names):
        unit = buffer.module.get_submodule(name)
        if module_is_fully_no_shard(unit):
            continue  # replicated: no gathering hooks
        groups: list[int] = []
        for p in unit.parameters():
            gid = buffer.group_of(p)[0]
            if gid not in groups:
                groups.append(gid)
        out.append((index, groups, [g for g in groups if g not in roots]))
    return out


def _releases(buffer: ParamAndGradBuffer, sequence) -> list[list[int]]:
    """The buckets each unit of ``sequence`` releases after it ran: its own, and a
    bucket coalesced units share after the last of them in the sequence (hooks.py)."""
    last: dict[int, int] = {}
    for pos, (index, _groups, release) in enumerate(sequence):
        for gid in release:
            if index in buffer.groups[gid].coalesced_unit_ids:
                last[gid] = pos
    return [
        [g for g in release if last.get(g, pos) == pos]
        for pos, (_i, _groups, release) in enumerate(sequence)
    ]


def _zero3_peak(buffer: ParamAndGradBuffer, prefetch_depth: int) -> int:
    pipe = AllGatherPipeline(buffer, prefetch_depth=prefetch_depth)
    copies = [_rank_major_copy(buffer, g) for g in range(buffer.num_buckets)]
    peak = 0

    def held() -> int:
        storages: dict[tuple[str, int], int] = {}
        for gid, group in enumerate(buffer.groups):
            if pipe.is_distributed(gid):
                assert group.model_weight_buffer is not None
                bucket = group.model_weight_buffer.unsharded_tensor()
                storages[storage_key(bucket)] = bucket.untyped_storage().nbytes()
        in_flight = sum(
            copies[g] for g, s in enumerate(pipe.status) if s is BucketStatus.GATHER_IN_PROGRESS
        )
        return sum(storages.values()) + in_flight

    def gather(ids: list[int], order: PrefetchOrder | None) -> None:
        nonlocal peak
        pipe.all_gather_params(
            ids,
            prefetch=order is not None,
            prefetch_order=order or PrefetchOrder.FORWARD_PASS_ORDER,
            wait_bucket_ready=False,
        )
        peak = max(peak, held())
        for gid in ids:
            pipe.wait_bucket_ready(gid)

    units = _units(buffer)
    gather(list(buffer.root_groups), None)
    for order, sequence in (
        (PrefetchOrder.FORWARD_PASS_ORDER, units),
        (PrefetchOrder.BACKWARD_PASS_ORDER, units[::-1]),
    ):
        for (_index, groups, _release), release in zip(
            sequence, _releases(buffer, sequence), strict=True
        ):
            gather(groups, order)
            for gid in release:
                pipe.release_bucket(gid)
    pipe.reset()
    return peak


def _sync_peak(buffer: ParamAndGradBuffer, overlap_param_gather: bool) -> int:
    """``install_optimized_model_weights``: each gathering group's rank-major copy is held
    from its all-gather until the next group's is started and it is waited on; with
    ``overlap_param_gather`` only the groups that cannot be stale."""
    copies: list[int] = []
    for gid, group in enumerate(buffer.groups):
        mw = group.model_weight_buffer
        assert mw is not None
        bucket = buffer.buckets[gid]
        if not group.requires_grad or bucket.outer_sharded:
            continue
        if overlap_param_gather and bucket.can_be_stale:
            continue
        if bucket.sharding.main_weights and not mw.is_data_distributed:
            copies.append(_rank_major_copy(buffer, gid))
    return max((a + b for a, b in zip([0, *copies], copies, strict=False)), default=0)


def _stale_peak(buffer: ParamAndGradBuffer, prefetch_depth: int) -> int:
    """The next forward's gathers of the groups a step left stale (see the module note)."""
    stale = [b for b in buffer.buckets if b.can_be_stale]
    if not stale:
        return 0
    pipe = AllGatherPipeline(buffer, prefetch_depth=prefetch_depth)
    copies = [_rank_major_copy(buffer, g) for g in range(buffer.num_buckets)]
    for bucket in stale:
        bucket.mark_stale()
    peak = 0

    def gather(ids: list[int], prefetch: bool) -> None:
        nonlocal peak
        pipe.all_gather_params(ids, prefetch=prefetch, wait_bucket_ready=False)
        in_flight = sum(
            copies[g] for g, s in enumerate(pipe.status) if s is BucketStatus.GATHER_IN_PROGRESS
        )
        peak = max(peak, in_flight)
        for gid in ids:
            pipe.wait_bucket_ready(gid)

    gather(list(buffer.root_groups), False)
    for _index, groups, _release in _units(buffer):
        gather(groups, True)
    pipe.land_stale()
    return peak


def gathered_peak(
    buffer: ParamAndGradBuffer, prefetch_depth: int = 1, overlap_param_gather: bool = True
) -> int:
    """Bytes of gathered weights held at once by this rank (see the module note); run
    inside the fake world the buffer was built in."""
    stale = _stale_peak(buffer, prefetch_depth) if overlap_param_gather else 0
    return max(_zero3_peak(buffer, prefetch_depth), _sync_peak(buffer, overlap_param_gather), stale)
