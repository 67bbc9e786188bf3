"""Where each parameter goes in a group's shards: ``compute_layout`` lays shapes out as
``torch.chunk`` pieces (Note [shard layout] in ``layout``), a parameter with an owner held
whole by that shard after the uniform region, and ``assign_owners`` balances the owners
(Note [whole placement] in ``layout``). The ``FlatLayout`` built checks every invariant.

Arithmetic on shapes; no tensors, no process groups.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

from fsdp_buffers.layout import DEFAULT_ALIGNMENT, FlatLayout, ParamSlot

__all__ = ["assign_owners", "compute_layout"]


def _align_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _normalize_shapes(shapes: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    result = []
    for i, shape in enumerate(shapes):
        try:
            dims = tuple(operator.index(d) for d in shape)
        except TypeError as exc:
            raise TypeError(
                f"shape of param {i} must be a sequence of ints, got {shape!r}"
            ) from exc
        if any(d < 0 for d in dims):
            raise ValueError(f"shape of param {i} has a negative dim: {dims}; dims must be >= 0")
        result.append(dims)
    return result


def assign_owners(
    sizes: Sequence[int], shard_count: int, prior: Sequence[int] | None = None
) -> tuple[int, ...]:
    """An owner shard for each of ``sizes`` (elements), balanced greedily, largest first:
    each goes to the shard with the least load in this call, ties to the one with the
    least ``prior`` load (what earlier buckets gave it), then to the lowest index. So a
    bucket with fewer matrices than shards still spreads its matrices' optimizer work
    over the shards across buckets (Note [whole placement])."""
    if shard_count < 1:
        raise ValueError(f"shard_count must be >= 1, got {shard_count}")
    base = list(prior) if prior is not None else [0] * shard_count
    if len(base) != shard_count:
        raise ValueError(f"prior has {len(base)} loads for {shard_count} shards")
    load = [0] * shard_count
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        k = min(range(shard_count), key=lambda k: (load[k], base[k], k))
        owners[i] = k
        load[k] += sizes[i]
    return tuple(owners)


def compute_layout(
    shapes: Sequence[Sequence[int]],
    shard_count: int,
    alignment: int = DEFAULT_ALIGNMENT,
    owners: Sequence[int | None] | None = None,
) -> FlatLayout:
    """Lay ``shapes`` out, in order, as ``torch.chunk`` pieces over ``shard_count`` ranks
    (Note [shard layout]); a parameter with an owner in ``owners`` is held whole by that
    shard instead (Note [whole placement])."""
    shard_count = operator.index(shard_count)
    alignment = operator.index(alignment)
    if shard_count < 1:
        raise ValueError(f"shard_count must be >= 1, got {shard_count}")
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1 (elements), got {alignment}")
    dims_list = _normalize_shapes(shapes)
    owner_of = list(owners) if owners is not None else [None] * len(dims_list)
    if len(owner_of) != len(dims_list):
        raise ValueError(f"owners has {len(owner_of)} entries for {len(dims_list)} shapes")
    for i, (dims, owner) in enumerate(zip(dims_list, owner_of, strict=True)):
        if owner is not None and (not dims or not 0 <= owner < shard_count):
            raise ValueError(
                f"param {i} (shape {dims}) cannot be owned whole by shard {owner}: a whole "
                f"parameter has at least one dim and an owner in [0, {shard_count})"
            )
    slots: list[ParamSlot | None] = [None] * len(dims_list)
    cursor = 0
    for i, dims in enumerate(dims_list):
        if owner_of[i] is not None:
            continue
        replicated = len(dims) == 0
        rows = dims[0] if dims else 1
        slot = ParamSlot(
            index=i,
            shape=dims,
            offset=cursor,
            numel=math.prod(dims),
            row_numel=math.prod(dims[1:]),
            chunk_rows=1 if replicated else -(-rows // shard_count),
            replicated=replicated,
        )
        slots[i] = slot
        cursor += slot.width
    rank_end = [cursor] * shard_count
    for i, dims in enumerate(dims_list):
        owner = owner_of[i]
        if owner is None:
            continue
        slot = ParamSlot(
            index=i,
            shape=dims,
            offset=rank_end[owner],
            numel=math.prod(dims),
            row_numel=math.prod(dims[1:]),
            chunk_rows=dims[0],
            owner=owner,
        )
        slots[i] = slot
        rank_end[owner] += slot.width
    return FlatLayout(
        slots=tuple(s for s in slots if s is not None),
        shard_count=shard_count,
        shard_numel=_align_up(max(rank_end), alignment),
        alignment=alignment,
    )
