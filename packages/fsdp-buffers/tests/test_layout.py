"""Tests for the flat layout: invariants as properties, optimality against brute force,
and padding of real transformer groups (pure arithmetic, nothing allocated)."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_buffers import layout as layout_module
from fsdp_buffers.layout import DEFAULT_ALIGNMENT, FlatLayout, ParamSlot, compute_layout

ALIGNMENTS = [1, 2, 3, 4, 8, 16, 64]

shapes_st = st.lists(
    st.lists(st.integers(0, 40), min_size=0, max_size=4).map(tuple), min_size=1, max_size=30
)
small_shapes_st = st.lists(
    st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=6
)
shard_count_st = st.integers(1, 8)
alignment_st = st.sampled_from(ALIGNMENTS)


def _align_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def check_invariants(layout: FlatLayout, shapes) -> None:
    """Every invariant the layout promises, checked from the public API only."""
    n, s, a = layout.shard_count, layout.shard_numel, layout.alignment
    assert layout.total_numel == n * s
    assert s % a == 0
    assert len(layout.slots) == len(shapes)
    assert layout.used_numel == sum(math.prod(sh) for sh in shapes)
    assert layout.padding_numel == layout.total_numel - layout.used_numel >= 0
    if layout.total_numel:
        assert layout.padding_fraction == layout.padding_numel / layout.total_numel
    else:
        assert layout.padding_fraction == 0.0
    for k in range(n):
        assert layout.shard_bounds(k) == (k * s, (k + 1) * s)

    cursor = 0
    for i, (slot, shape) in enumerate(zip(layout.slots, shapes, strict=True)):
        # Slots are in order, faithful to the shapes, non-overlapping, inside the buffer.
        assert slot.index == i
        assert slot.shape == tuple(shape)
        assert slot.numel == math.prod(shape)
        assert slot.row_numel == math.prod(shape[1:])
        assert slot.rows == (shape[0] if shape else 1)
        assert cursor <= slot.offset
        assert slot.offset + slot.numel <= layout.total_numel
        cursor = slot.offset + slot.numel

        parts = layout.row_partition(i)
        assert len(parts) == n
        # Row parts are contiguous, in rank order, and cover [0, rows) exactly once.
        assert parts[0][0] == 0
        assert parts[-1][1] == slot.rows
        for k, (r0, r1) in enumerate(parts):
            assert r0 <= r1
            if k:
                assert parts[k - 1][1] == r0
            assert layout.local_rows(i, k) == (r0, r1)
            start, end = layout.local_span(i, k)
            assert (start, end) == (
                slot.offset + r0 * slot.row_numel,
                slot.offset + r1 * slot.row_numel,
            )
            if start < end:
                lo, hi = layout.shard_bounds(k)
                assert lo <= start and end <= hi
        if slot.numel:
            # A rank holds exactly the param's elements that fall in its shard.
            for k in range(n):
                lo, hi = layout.shard_bounds(k)
                want = max(0, min(hi, slot.offset + slot.numel) - max(lo, slot.offset))
                start, end = layout.local_span(i, k)
                assert end - start == want
        else:
            # Zero-numel params: one rank (the one whose shard holds the offset, else
            # the last) has all rows, the others none.
            owner = slot.offset // s if slot.offset < layout.total_numel else n - 1
            for k, part in enumerate(parts):
                want = (0, slot.rows) if k == owner else (0, 0) if k < owner else (slot.rows,) * 2
                assert part == want


def check_element_ownership(layout: FlatLayout) -> None:
    """Plain per-element bookkeeping: every element of every param owned once, by the
    rank whose shard holds it."""
    owner = [None] * layout.total_numel
    for i, _slot in enumerate(layout.slots):
        for k in range(layout.shard_count):
            start, end = layout.local_span(i, k)
            for e in range(start, end):
                assert owner[e] is None, f"element {e} owned twice"
                owner[e] = (i, k)
    for i, slot in enumerate(layout.slots):
        for e in range(slot.offset, slot.offset + slot.numel):
            assert owner[e] == (i, e // layout.shard_numel), f"element {e} of param {i}"
    assert sum(o is not None for o in owner) == layout.used_numel


def brute_force_fits(shapes, shard_count: int, shard_numel: int) -> bool:
    """Whether any valid layout with this shard size exists, by scanning every offset.

    Taking the earliest valid offset for each param is enough: from an earlier cursor
    the earliest valid offset is never later.
    """
    s = shard_numel
    limit = shard_count * s
    cursor = 0
    for shape in shapes:
        n, r = math.prod(shape), math.prod(shape[1:])
        if n == 0:
            continue
        for p in range(cursor, limit - n + 1):
            first = (p // s + 1) * s
            if all((m - p) % r == 0 for m in range(first, p + n, s)):
                cursor = p + n
                break
        else:
            return False
    return True


def brief_shard_numel(shapes, shard_count: int, alignment: int) -> int:
    """The simpler rule from the design brief: S a multiple of lcm(alignment, rows of
    params with numel > S), shift to the next row, step by that lcm on failure."""
    numels = [math.prod(sh) for sh in shapes]
    rows = [math.prod(sh[1:]) for sh in shapes]
    total = sum(numels)
    s = _align_up(-(-total // shard_count), alignment)

    def lcm_for(s: int) -> int:
        return math.lcm(alignment, *(r for n, r in zip(numels, rows, strict=True) if n > s))

    while True:
        while s % lcm_for(s):
            s = _align_up(s, lcm_for(s))
        o, ok = 0, True
        for n, r in zip(numels, rows, strict=True):
            if n == 0:
                continue
            b = (o // s + 1) * s
            if b < o + n:
                o += (b - o) % r
                if any((m - o) % r for m in range(o // s * s + s, o + n, s)):
                    ok = False
                    break
            o += n
        if ok and o <= shard_count * s:
            return s
        s += lcm_for(s)


@settings(max_examples=300, deadline=None)
@given(shapes=shapes_st, shard_count=shard_count_st, alignment=alignment_st)
def test_invariants_hold_for_random_groups(shapes, shard_count, alignment):
    layout = compute_layout(shapes, shard_count, alignment)
    assert layout.shard_count == shard_count and layout.alignment == alignment
    check_invariants(layout, shapes)
    # Never worse than the brief's simpler rule.
    assert layout.shard_numel <= brief_shard_numel(shapes, shard_count, alignment)


@settings(max_examples=250, deadline=None)
@given(shapes=small_shapes_st, shard_count=shard_count_st, alignment=alignment_st)
def test_small_groups_element_ownership_and_minimal_shard(shapes, shard_count, alignment):
    layout = compute_layout(shapes, shard_count, alignment)
    check_invariants(layout, shapes)
    check_element_ownership(layout)
    # The chosen shard size is the smallest aligned one any valid layout can use.
    assert brute_force_fits(shapes, shard_count, layout.shard_numel)
    total = sum(math.prod(sh) for sh in shapes)
    for s in range(_align_up(-(-total // shard_count), alignment), layout.shard_numel, alignment):
        assert not brute_force_fits(shapes, shard_count, s), f"S={s} also fits"


def llama_layer(hidden: int, ffn: int) -> list[tuple[int, ...]]:
    attn = [(hidden, hidden)] * 4  # q, k, v, o
    mlp = [(ffn, hidden), (ffn, hidden), (hidden, ffn)]  # gate, up, down
    return [*attn, *mlp, (hidden,), (hidden,)]  # two RMSNorm weights


GROUPS = {
    "llama7b_layer": llama_layer(4096, 11008),
    "llama7b_embedding": [(32000, 4096)],
    "llama7b_output": [(32000, 4096)],
    "llama13b_layer": llama_layer(5120, 13824),
    "llama13b_embedding": [(32000, 5120)],
}


@pytest.mark.parametrize("shard_count", [8, 64])
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_transformer_groups_pad_at_most_one_percent(group, shard_count):
    shapes = GROUPS[group]
    layout = compute_layout(shapes, shard_count)
    check_invariants(layout, shapes)
    assert layout.padding_fraction <= 0.01, (group, shard_count, layout.padding_fraction)


def test_llama_layer_layout_is_fast():
    shapes = llama_layer(4096, 11008)
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        compute_layout(shapes, 64)
        best = min(best, time.perf_counter() - start)
    assert best < 0.05, f"compute_layout took {best * 1e3:.1f} ms"


@pytest.mark.parametrize("shard_count", [2, 8, 64])
@pytest.mark.parametrize("group", ["llama7b_layer", "llama13b_layer", "mixed"])
def test_budget_fallback_still_gives_a_valid_layout(monkeypatch, group, shard_count):
    # With no search budget the first failed candidate falls back to the proven size.
    shapes = GROUPS.get(group) or [(7, 33), (5,), (3, 31, 2), (1, 90), (40, 3), ()] * 5
    exact = compute_layout(shapes, shard_count, alignment=8)
    monkeypatch.setattr(layout_module, "_SEARCH_BUDGET", 1)
    fallback = compute_layout(shapes, shard_count, alignment=8)
    check_invariants(fallback, shapes)
    assert fallback.shard_numel >= exact.shard_numel


def test_single_row_param_larger_than_even_share_is_whole_on_one_rank():
    shapes = [(10,), (1, 1000), (3, 7)]
    layout = compute_layout(shapes, 4, alignment=8)
    check_invariants(layout, shapes)
    assert layout.slots[1].numel > -(-1031 // 4)  # more than an even share
    parts = layout.row_partition(1)
    assert sum(1 for r0, r1 in parts if r1 > r0) == 1
    owner = next(k for k, (r0, r1) in enumerate(parts) if r1 > r0)
    lo, hi = layout.shard_bounds(owner)
    assert layout.local_span(1, owner) == (layout.slots[1].offset, layout.slots[1].offset + 1000)
    assert lo <= layout.slots[1].offset and layout.slots[1].offset + 1000 <= hi


def test_shard_count_one_is_aligned_total_with_params_back_to_back():
    shapes = [(3, 5), (), (7,)]
    layout = compute_layout(shapes, 1)
    aligned_total = -(-23 // DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT  # 23 elements in all
    assert layout.shard_numel == aligned_total
    assert [s.offset for s in layout.slots] == [0, 15, 16]
    assert layout.row_partition(0) == ((0, 3),)
    assert layout.padding_numel == aligned_total - 23


def test_row_aligned_boundaries_split_a_matrix_by_rows():
    layout = compute_layout([(8, 4)], 4, alignment=4)
    assert layout.shard_numel == 8
    assert layout.row_partition(0) == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert layout.local_span(0, 2) == (16, 24)
    assert layout.padding_numel == 0


def test_param_is_shifted_so_the_boundary_falls_between_rows():
    # T = 14. S = 7 cannot work: the (3, 4) param must end by 14, so start by 2, and
    # then the boundary at 7 is 5 elements in, inside a row. With S = 8 the boundary is
    # 6 elements past the cursor 2: the param moves to offset 4 (2 elements of padding).
    layout = compute_layout([(2,), (3, 4)], 2, alignment=1)
    check_invariants(layout, [(2,), (3, 4)])
    assert layout.shard_numel == 8 and layout.slots[1].offset == 4
    assert layout.row_partition(1) == ((0, 1), (1, 3))
    assert layout.padding_numel == 2


def test_scalar_is_one_row_of_one_element():
    layout = compute_layout([(), (5,)], 2, alignment=1)
    slot = layout.slots[0]
    assert (slot.rows, slot.row_numel, slot.numel) == (1, 1, 1)
    assert layout.row_partition(0) == ((0, 1), (1, 1))


def test_zero_numel_params_take_no_space_and_have_one_owner():
    shapes = [(0,), (4, 0), (64,), (5, 0, 3), (0, 9), (64,), (2, 0)]
    layout = compute_layout(shapes, 2, alignment=64)
    check_invariants(layout, shapes)
    assert [s.offset for s in layout.slots] == [0, 0, 0, 64, 64, 64, 128]
    assert layout.row_partition(1) == ((0, 4), (4, 4))
    assert layout.row_partition(3) == ((0, 0), (0, 5))  # offset 64 is in shard 1
    assert layout.row_partition(4) == ((0, 0), (0, 0))  # no rows at all
    assert layout.row_partition(6) == ((0, 0), (0, 2))  # offset == total: the last rank
    assert layout.local_span(6, 1) == (128, 128)


def test_empty_group_and_all_empty_params():
    for shapes in ([], [(0,), (3, 0)]):
        layout = compute_layout(shapes, 4)
        check_invariants(layout, shapes)
        assert layout.shard_numel == 0 and layout.total_numel == 0
        assert layout.padding_fraction == 0.0


class _Index:
    """An int-like object, as a 0-d integer tensor is."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


class _Size(tuple):
    """A tuple subclass, as torch.Size is."""


def test_accepts_any_int_sequences():
    layout = compute_layout([_Size([4, 3]), [2], (_Index(5),)], 2, alignment=1)
    assert [s.shape for s in layout.slots] == [(4, 3), (2,), (5,)]
    assert all(type(d) is int for s in layout.slots for d in s.shape)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([(2,)], 0), "shard_count must be >= 1, got 0"),
        (([(2,)], -3), "shard_count must be >= 1, got -3"),
        (([(2,)], 2, 0), r"alignment must be >= 1 \(elements\), got 0"),
        (([(2, -1)], 2), r"shape of param 0 has a negative dim: \(2, -1\)"),
    ],
)
def test_bad_arguments_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        compute_layout(*args)


def test_non_int_dims_raise_type_error():
    with pytest.raises(TypeError, match="shape of param 1 must be a sequence of ints"):
        compute_layout([(2,), (2.5,)], 2)


def test_accessors_reject_out_of_range_arguments():
    layout = compute_layout([(4, 4)], 2)
    with pytest.raises(ValueError, match=r"shard_rank must be in \[0, 2\), got 2"):
        layout.local_rows(0, 2)
    with pytest.raises(ValueError, match=r"shard_rank must be in \[0, 2\), got -1"):
        layout.shard_bounds(-1)
    with pytest.raises(IndexError, match=r"param index must be in \[0, 1\), got 1"):
        layout.local_span(1, 0)


def test_flat_layout_rejects_invalid_placements():
    slot = ParamSlot(index=0, shape=(3, 4), offset=0, numel=12, row_numel=4)
    with pytest.raises(ValueError, match="inside a row"):
        FlatLayout(slots=(slot,), shard_count=2, shard_numel=6, alignment=1)
    with pytest.raises(ValueError, match="past the buffer"):
        FlatLayout(slots=(slot,), shard_count=1, shard_numel=8, alignment=1)
    with pytest.raises(ValueError, match="multiple of alignment"):
        FlatLayout(slots=(slot,), shard_count=2, shard_numel=6, alignment=4)
    other = ParamSlot(index=1, shape=(2,), offset=11, numel=2, row_numel=1)
    with pytest.raises(ValueError, match="overlaps"):
        FlatLayout(slots=(slot, other), shard_count=2, shard_numel=8, alignment=1)
    with pytest.raises(ValueError, match="do not match shape"):
        ParamSlot(index=0, shape=(3, 4), offset=0, numel=11, row_numel=4)
    assert FlatLayout(slots=(slot,), shard_count=3, shard_numel=4, alignment=2).padding_numel == 0


def test_layout_is_frozen_and_comparable():
    a = compute_layout([(4, 4), (3,)], 2)
    assert a == compute_layout([(4, 4), (3,)], 2)
    with pytest.raises(AttributeError):
        a.shard_numel = 1  # type: ignore[misc]
