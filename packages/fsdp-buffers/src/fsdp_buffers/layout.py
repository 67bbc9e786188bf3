"""Flat layout of a parameter group: where each parameter lives in the sharded flat buffer.

A group packs its parameters, in order, into one flat buffer of ``shard_count * S``
elements; rank ``k`` of the shard group owns ``[k*S, (k+1)*S)``. A parameter is never
split by padding or reordered, so after an all-gather it is the contiguous view
``[offset, offset + numel)``. Each shard boundary strictly inside a parameter must fall
between two of its rows, so every rank holds whole rows (a dim-0 slice, maybe empty) and
its local shard is a plain ``Shard(0)`` piece. ``S`` is a multiple of ``alignment``.
This module is pure integer arithmetic on shapes: no tensors, no process groups.

Algorithm (``compute_layout``). ``T`` = total numel, ``N`` = shard count.

1. Candidate sizes. ``S`` starts at ``align_up(ceil(T / N), alignment)`` and only grows.
   A parameter with ``numel > 2*S`` contains two boundaries wherever it goes, which
   forces ``row_numel | S``; so a candidate must be a multiple of
   ``L(S) = lcm(alignment, row_numel of every param with numel > 2*S)``. The next
   candidate is the smaller of ``align_up(S, L(S))`` and the size at which the smallest
   of those parameters drops out of the set (then ``L`` is recomputed). ``N == 1``
   needs no special case: ``S = align_up(T, alignment)``, parameters back to back.
2. Packing. For a candidate, place each parameter at the *earliest* valid offset at or
   after the cursor, in O(1): with ``b`` the first boundary past the cursor ``o``, it
   fits before ``b``; or it starts at ``o + (b - o) % r`` so that ``b`` lands on a row;
   or, when ``S % r != 0`` and a second boundary would then fall inside it, at
   ``b + S % r`` (one boundary, on a row) if that keeps the next boundary out; else no
   offset works at this ``S``. Earliest placement from an earlier cursor is never later,
   so greedy gives the smallest possible end: the candidate is feasible iff it fits in
   ``N * S``. Otherwise try the next candidate above ``S``.

The first feasible candidate is the smallest shard size (least padding) any valid layout
of these parameters in this order can have, so it is never above what the simpler rule
"``S`` a multiple of every row size with ``numel > S``, shift to the next row" finds.
It exists: ``S = align_up(T, alignment)`` puts everything in shard 0. Transformer groups
need a handful of candidates; to bound the time on pathological groups (thousands of
parameters with rows hundreds of times the alignment) the search stops after
``_SEARCH_BUDGET`` parameter placements (~0.1 s) and takes the smallest ``S`` proven to
fit: a multiple of every row size with ``numel > S`` and ``N * S >= T + (N - 1) *
(max_row - 1)``, as each of the ``N - 1`` inner boundaries costs one shift of under a row.

Parameters with zero elements (some dim is 0) take no space: ``offset`` is the cursor
where they were reached, and all their rows belong to the rank whose shard contains
``offset`` (the last rank when ``offset == total_numel``); other ranks hold none.
0-d parameters are one row of one element.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["DEFAULT_ALIGNMENT", "FlatLayout", "ParamSlot", "compute_layout"]

DEFAULT_ALIGNMENT: int = 16
"""Shard alignment in elements: every shard starts 16-byte aligned even in a 1-byte dtype
(fp8; 32 B of bf16, 64 B of fp32), what vectorized copies and NCCL want. A larger one
only adds padding, up to ``shard_count * (alignment - 1)`` elements a bucket."""

# Parameter placements the exact search may spend before falling back to a size proven
# to fit (see the module docstring). Realistic groups use a tiny fraction of it.
_SEARCH_BUDGET = 1 << 20


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in the unsharded flat buffer."""

    index: int  # position in the group
    shape: tuple[int, ...]
    offset: int  # element offset in the unsharded flat buffer
    numel: int
    row_numel: int  # prod(shape[1:]); 1 for 0-d and 1-d params

    def __post_init__(self) -> None:
        numel = math.prod(self.shape)
        row_numel = math.prod(self.shape[1:])
        if self.numel != numel or self.row_numel != row_numel:
            raise ValueError(
                f"ParamSlot {self.index}: numel={self.numel}, row_numel={self.row_numel} do "
                f"not match shape {self.shape} (expected {numel} and {row_numel})"
            )
        if self.offset < 0:
            raise ValueError(f"ParamSlot {self.index}: offset must be >= 0, got {self.offset}")

    @property
    def rows(self) -> int:
        """Number of dim-0 rows: ``shape[0]``, or 1 for a 0-d parameter."""
        return self.shape[0] if self.shape else 1


@dataclass(frozen=True)
class FlatLayout:
    """Placement of a group's parameters in a flat buffer of ``shard_count`` equal shards.

    Constructing one checks every invariant (ordered, non-overlapping slots inside the
    buffer; aligned shards; boundaries inside parameters on row boundaries), so a
    ``FlatLayout`` is always valid.
    """

    slots: tuple[ParamSlot, ...]
    shard_count: int
    shard_numel: int  # S
    alignment: int
    # Cached so the properties and the hot-path accessors stay O(1).
    _used_numel: int = field(init=False, repr=False, compare=False)
    # For zero-numel slots, the rank holding all their rows; -1 for the others.
    _zero_owner: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n, s, a = self.shard_count, self.shard_numel, self.alignment
        if n < 1 or a < 1 or s < 0 or s % a:
            raise ValueError(
                f"FlatLayout needs shard_count >= 1, alignment >= 1 and shard_numel a "
                f"non-negative multiple of alignment; got shard_count={n}, "
                f"shard_numel={s}, alignment={a}"
            )
        total = n * s
        cursor = 0
        used = 0
        zero_owner = []
        for i, slot in enumerate(self.slots):
            if slot.index != i:
                raise ValueError(f"FlatLayout slot at position {i} has index {slot.index}")
            if slot.offset < cursor:
                raise ValueError(
                    f"FlatLayout slot {i} at offset {slot.offset} overlaps the previous "
                    f"slot, which ends at {cursor}"
                )
            end = slot.offset + slot.numel
            if end > total:
                raise ValueError(
                    f"FlatLayout slot {i} ends at {end}, past the buffer of {total} elements"
                )
            if slot.numel:
                # Every boundary strictly inside the slot must sit between two rows.
                boundary = (slot.offset // s + 1) * s
                while boundary < end:
                    if (boundary - slot.offset) % slot.row_numel:
                        raise ValueError(
                            f"FlatLayout slot {i} (shape {slot.shape}, offset {slot.offset}) "
                            f"is cut by the shard boundary {boundary} inside a row"
                        )
                    boundary += s
                zero_owner.append(-1)
            else:
                zero_owner.append(slot.offset // s if slot.offset < total else n - 1)
            cursor = end
            used += slot.numel
        object.__setattr__(self, "_used_numel", used)
        object.__setattr__(self, "_zero_owner", tuple(zero_owner))

    @property
    def total_numel(self) -> int:
        """Elements in the unsharded flat buffer: ``shard_count * shard_numel``."""
        return self.shard_count * self.shard_numel

    @property
    def used_numel(self) -> int:
        """Elements that belong to parameters."""
        return self._used_numel

    @property
    def padding_numel(self) -> int:
        return self.total_numel - self._used_numel

    @property
    def padding_fraction(self) -> float:
        """Padding over total elements; 0.0 for an empty buffer."""
        total = self.total_numel
        return (total - self._used_numel) / total if total else 0.0

    def _check_rank(self, shard_rank: int) -> None:
        if not 0 <= shard_rank < self.shard_count:
            raise ValueError(f"shard_rank must be in [0, {self.shard_count}), got {shard_rank}")

    def _slot(self, index: int) -> ParamSlot:
        if not 0 <= index < len(self.slots):
            raise IndexError(f"param index must be in [0, {len(self.slots)}), got {index}")
        return self.slots[index]

    def shard_bounds(self, shard_rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``shard_rank``'s shard in the flat buffer."""
        self._check_rank(shard_rank)
        start = shard_rank * self.shard_numel
        return start, start + self.shard_numel

    def local_rows(self, index: int, shard_rank: int) -> tuple[int, int]:
        """``[row_start, row_end)`` of param ``index`` held by ``shard_rank``.

        Empty parts are ``(k, k)`` with ``k = 0`` for ranks before the parameter and
        ``k = rows`` for ranks after it, so the parts are contiguous in rank order.
        """
        # Hot path: checks inlined.
        if not (0 <= index < len(self.slots) and 0 <= shard_rank < self.shard_count):
            self._slot(index)
            self._check_rank(shard_rank)
        slot = self.slots[index]
        if slot.numel == 0:
            owner = self._zero_owner[index]
            if shard_rank < owner:
                return 0, 0
            return (0, slot.rows) if shard_rank == owner else (slot.rows, slot.rows)
        numel, row = slot.numel, slot.row_numel
        start = shard_rank * self.shard_numel - slot.offset
        end = start + self.shard_numel
        # Boundaries inside the param are on rows, so these divisions are exact.
        return (
            min(max(start, 0), numel) // row,
            min(max(end, 0), numel) // row,
        )

    def local_span(self, index: int, shard_rank: int) -> tuple[int, int]:
        """``[start, end)`` flat offsets of ``shard_rank``'s part of param ``index``."""
        row_start, row_end = self.local_rows(index, shard_rank)
        slot = self.slots[index]
        return (
            slot.offset + row_start * slot.row_numel,
            slot.offset + row_end * slot.row_numel,
        )

    def row_partition(self, index: int) -> tuple[tuple[int, int], ...]:
        """``local_rows(index, k)`` for every rank ``k``, in rank order."""
        return tuple(self.local_rows(index, k) for k in range(self.shard_count))


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


def _pack(
    numels: list[int], row_numels: list[int], shard_numel: int, limit: int
) -> list[int] | None:
    """Earliest valid offsets for every param with shards of ``shard_numel``, or None
    if they do not fit in ``limit`` elements."""
    s = shard_numel
    offsets = []
    o = 0
    for n, r in zip(numels, row_numels, strict=True):
        if n:
            b = (o // s + 1) * s  # first boundary strictly after the cursor
            if o + n > b:  # b would fall inside: move it onto a row boundary
                o += (b - o) % r
                if n > s and s % r and o + n > b + s:
                    # A second boundary would fall off-row. The only other option is
                    # one boundary, b + s, on a row: start at b + s % r. Periodic in s,
                    # so if that fails no later offset works either.
                    o = b + s % r
                    if o + n > b + 2 * s:
                        return None
            if o + n > limit:
                return None
        offsets.append(o)
        o += n
    return offsets


def _fallback_shard_numel(
    numels: list[int], row_numels: list[int], shard_count: int, alignment: int
) -> int:
    """A shard size that always packs (module docstring): a multiple of every row size
    with numel > S, with room for one sub-row shift per inner boundary."""
    total = sum(numels)
    max_row = max((r for n, r in zip(numels, row_numels, strict=True) if n), default=1)
    s = _align_up(-(-(total + (shard_count - 1) * (max_row - 1)) // shard_count), alignment)
    while True:
        lcm = math.lcm(alignment, *(r for n, r in zip(numels, row_numels, strict=True) if n > s))
        if s % lcm == 0:
            return s
        s = _align_up(s, lcm)


def compute_layout(
    shapes: Sequence[Sequence[int]],
    shard_count: int,
    alignment: int = DEFAULT_ALIGNMENT,
) -> FlatLayout:
    """Lay ``shapes`` out, in order, in a flat buffer of ``shard_count`` equal shards
    with the smallest shard size that keeps every rank's part of every param whole rows.
    """
    shard_count = operator.index(shard_count)
    alignment = operator.index(alignment)
    if shard_count < 1:
        raise ValueError(f"shard_count must be >= 1, got {shard_count}")
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1 (elements), got {alignment}")
    dims = _normalize_shapes(shapes)
    numels = [math.prod(d) for d in dims]
    row_numels = [math.prod(d[1:]) for d in dims]
    total = sum(numels)

    # Row sizes that must divide S once some param with that row size has numel > 2*S:
    # for each row size its largest numel, largest first, with the running lcm.
    biggest: dict[int, int] = {}
    for n, r in zip(numels, row_numels, strict=True):
        if r > 1 and n > biggest.get(r, 0):
            biggest[r] = n
    constrained = sorted(((n, r) for r, n in biggest.items()), reverse=True)
    neg_numels = [-n for n, _ in constrained]
    prefix_lcm = [alignment]
    for _, r in constrained:
        prefix_lcm.append(math.lcm(prefix_lcm[-1], r))

    def next_candidate(s: int) -> int:
        while True:
            k = bisect.bisect_left(neg_numels, -2 * s)  # params with numel > 2*s
            lcm = prefix_lcm[k]
            if s % lcm == 0:
                return s
            # k >= 1 here: the smallest of those params stops constraining at ceil(n/2).
            release = _align_up(-(-constrained[k - 1][0] // 2), alignment)
            s = min(_align_up(s, lcm), release)

    shard_numel = _align_up(-(-total // shard_count), alignment)
    budget = _SEARCH_BUDGET
    while True:
        shard_numel = next_candidate(shard_numel)
        offsets = _pack(numels, row_numels, shard_numel, shard_count * shard_numel)
        if offsets is not None:
            break
        budget -= len(numels)
        if budget <= 0:
            shard_numel = max(
                shard_numel + alignment,
                _fallback_shard_numel(numels, row_numels, shard_count, alignment),
            )
            budget = _SEARCH_BUDGET  # the fallback fits at once; keep the loop uniform
            continue
        shard_numel += alignment

    slots = tuple(
        ParamSlot(index=i, shape=d, offset=o, numel=n, row_numel=r)
        for i, (d, o, n, r) in enumerate(zip(dims, offsets, numels, row_numels, strict=True))
    )
    return FlatLayout(
        slots=slots, shard_count=shard_count, shard_numel=shard_numel, alignment=alignment
    )
