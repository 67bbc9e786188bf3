"""Tests for the shard layout: invariants as properties (against DTensor's own chunk
arithmetic), padding of real transformer groups (pure arithmetic, nothing allocated)."""

from __future__ import annotations

import itertools
import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Shard

from fsdp_buffers.layout import DEFAULT_ALIGNMENT, FlatLayout, ParamSlot
from fsdp_buffers.slot_placement import assign_owners, compute_layout
from fsdp_mesh.testing import harness_device

ALIGNMENTS = [1, 2, 3, 4, 8, 16, 64]

shapes_st = st.lists(
    st.lists(st.integers(0, 40), min_size=0, max_size=4).map(tuple), min_size=1, max_size=30
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
        # Regions back to back in every shard, faithful to the shapes, inside the shard.
        assert slot.index == i
        assert slot.shape == tuple(shape)
        assert slot.numel == math.prod(shape)
        assert slot.row_numel == math.prod(shape[1:])
        assert slot.rows == (shape[0] if shape else 1)
        assert slot.offset == cursor
        cursor += slot.width
        assert cursor <= s
        assert layout.param_offset(i) == n * slot.offset
        parts = layout.row_partition(i)
        assert len(parts) == n
        if slot.replicated:  # 0-d: every rank holds the one element
            assert parts == ((0, 1),) * n
            continue
        for k, (r0, r1) in enumerate(parts):
            # DTensor's Shard(0) piece, by torch's own arithmetic.
            size, offset = Shard.local_shard_size_and_offset(slot.rows, n, k)
            assert (r0, r1) == (offset, offset + size), (shape, n, k)
            assert layout.local_rows(i, k) == (r0, r1)
            assert (r1 - r0) * slot.row_numel <= slot.width
        # Row parts are contiguous, in rank order, and cover [0, rows) exactly once.
        assert parts[0][0] == 0 and parts[-1][1] == slot.rows
        assert all(parts[k - 1][1] == parts[k][0] for k in range(1, n))


@settings(max_examples=300, deadline=None)
@given(shapes=shapes_st, shard_count=shard_count_st, alignment=alignment_st)
def test_invariants_hold_for_random_groups(shapes, shard_count, alignment):
    layout = compute_layout(shapes, shard_count, alignment)
    assert layout.shard_count == shard_count and layout.alignment == alignment
    check_invariants(layout, shapes)
    # The shard is the regions and less than one alignment unit of padding.
    used = sum(slot.width for slot in layout.slots)
    assert layout.shard_numel == _align_up(used, alignment)


@settings(max_examples=100, deadline=None)
@given(shapes=shapes_st, shard_count=shard_count_st, alignment=alignment_st)
def test_pack_and_unpack_are_inverse_and_place_every_element(shapes, shard_count, alignment):
    layout = compute_layout(shapes, shard_count, alignment)
    g = torch.Generator().manual_seed(len(shapes) * 7 + shard_count)
    values = [torch.randn(sh, generator=g) for sh in shapes]
    pm = torch.zeros(layout.total_numel)
    for i, v in enumerate(values):
        pm[layout.param_offset(i) : layout.param_offset(i) + v.numel()] = v.reshape(-1)
    gathered = torch.empty(layout.total_numel)
    layout.pack(pm, gathered)
    for k in range(shard_count):
        shard = gathered[k * layout.shard_numel : (k + 1) * layout.shard_numel]
        alone = torch.empty(layout.shard_numel)
        layout.pack_rank(pm, k, alone)
        assert torch.equal(shard, alone)
        # With views kept for pm (a buffer's own tensor): made by the first call, read
        # by the second, and they follow in-place writes to pm.
        for scale in (1.0, 1.0, 2.0):
            pm.mul_(scale)
            kept = torch.full((layout.shard_numel,), float("nan"))  # every element written
            layout.pack_rank(pm, k, kept, keep_views=True)
            assert torch.equal(shard * (2.0 if scale == 2.0 else 1.0), kept)
        pm.div_(2.0)
        for slot, v in zip(layout.slots, values, strict=True):
            r0, r1 = layout.local_rows(slot.index, k)
            piece = v.reshape(-1) if slot.replicated else v[r0:r1].reshape(-1)
            region = shard[slot.offset : slot.offset + slot.width]
            assert torch.equal(region[: piece.numel()], piece)
            assert torch.count_nonzero(region[piece.numel() :]) == 0
        assert torch.count_nonzero(shard[sum(sl.width for sl in layout.slots) :]) == 0
    out = torch.full((layout.total_numel,), float("nan"))
    layout.unpack(gathered, out)
    for i, v in enumerate(values):
        start = layout.param_offset(i)
        assert torch.equal(out[start : start + v.numel()], v.reshape(-1))


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


def test_rows_fewer_than_ranks_leave_later_ranks_empty():
    layout = compute_layout([(3, 4)], 4, alignment=4)
    assert layout.row_partition(0) == ((0, 1), (1, 2), (2, 3), (3, 3))
    assert layout.slots[0].width == 4 and layout.shard_numel == 4


def test_shard_count_one_is_aligned_total_with_params_back_to_back():
    shapes = [(3, 5), (7,), ()]
    layout = compute_layout(shapes, 1)
    assert [s.offset for s in layout.slots] == [0, 15, 22]
    assert layout.shard_numel == _align_up(23, DEFAULT_ALIGNMENT)


def test_chunks_are_torch_chunk_pieces_padded_to_equal_regions():
    layout = compute_layout([(5, 2), (4,)], 2, alignment=1)
    assert layout.row_partition(0) == ((0, 3), (3, 5))  # torch.chunk: 3 + 2 rows
    assert layout.row_partition(1) == ((0, 2), (2, 4))
    assert [s.width for s in layout.slots] == [6, 2]
    assert layout.padding_numel == 2  # the second rank's missing row


def test_scalar_is_a_replicated_slot():
    layout = compute_layout([(), (5,)], 2, alignment=1)
    slot = layout.slots[0]
    assert slot.replicated and slot.width == 1 and slot.chunk_rows == 1
    assert layout.row_partition(0) == ((0, 1), (0, 1))


def test_zero_numel_params_take_no_space():
    shapes = [(4,), (0,), (0, 3), (2, 0), (6,)]
    layout = compute_layout(shapes, 2, alignment=1)
    assert [s.width for s in layout.slots] == [2, 0, 0, 0, 3]
    assert layout.row_partition(3) == ((0, 1), (1, 2))


def test_empty_group_and_all_empty_params():
    for shapes in ([], [(0,), (0, 4)]):
        layout = compute_layout(shapes, 4)
        assert layout.shard_numel == 0 and layout.total_numel == 0
        for k in range(4):  # nothing to pack, with or without kept views
            for keep_views in (False, True):
                out = torch.empty(0)
                layout.pack_rank(torch.empty(0), k, out, keep_views=keep_views)
                assert out.numel() == 0


class _Size(tuple):
    pass


class _Index:
    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v


def test_accepts_any_int_sequences():
    layout = compute_layout([_Size([4, 3]), [2], (_Index(5),)], 2, alignment=1)
    assert [s.shape for s in layout.slots] == [(4, 3), (2,), (5,)]


@pytest.mark.parametrize(
    "args, match",
    [
        (([(2,)], 0), "shard_count must be >= 1"),
        (([(2,)], 2, 0), "alignment must be >= 1"),
        (([(2, -1)], 2), "negative dim"),
    ],
)
def test_bad_arguments_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        compute_layout(*args)


def test_non_int_dims_raise_type_error():
    with pytest.raises(TypeError, match="sequence of ints"):
        compute_layout([(2,), (2.5,)], 2)


def test_accessors_reject_out_of_range_arguments():
    layout = compute_layout([(4, 4)], 2)
    with pytest.raises(ValueError, match="shard_rank must be in"):
        layout.local_rows(0, 2)
    with pytest.raises(IndexError, match="param index must be in"):
        layout.local_rows(1, 0)
    with pytest.raises(ValueError, match="coarse=3 must divide"):
        layout.unpack(torch.empty(layout.total_numel), torch.empty(layout.total_numel), 3)


def test_flat_layout_rejects_invalid_placements():
    slot = ParamSlot(index=0, shape=(4, 2), offset=0, numel=8, row_numel=2, chunk_rows=2)
    FlatLayout(slots=(slot,), shard_count=2, shard_numel=4, alignment=1)  # valid
    with pytest.raises(ValueError, match=r"torch\.chunk over 4 ranks gives 1"):
        FlatLayout(slots=(slot,), shard_count=4, shard_numel=4, alignment=1)
    with pytest.raises(ValueError, match="past the shard"):
        FlatLayout(slots=(slot,), shard_count=2, shard_numel=2, alignment=1)
    with pytest.raises(ValueError, match="non-negative multiple of alignment"):
        FlatLayout(slots=(slot,), shard_count=2, shard_numel=6, alignment=4)
    other = ParamSlot(index=1, shape=(2,), offset=5, numel=2, row_numel=1, chunk_rows=1)
    with pytest.raises(ValueError, match="must start at 4"):
        FlatLayout(slots=(slot, other), shard_count=2, shard_numel=8, alignment=1)
    with pytest.raises(ValueError, match="exactly the 0-d parameters are replicated"):
        ParamSlot(index=0, shape=(), offset=0, numel=1, row_numel=1, chunk_rows=1)


def test_layout_is_frozen_and_comparable():
    a = compute_layout([(4, 4), (3,)], 2)
    assert a == compute_layout([(4, 4), (3,)], 2)
    assert a != compute_layout([(4, 4), (3,)], 4)
    with pytest.raises(AttributeError):
        a.shard_numel = 3  # type: ignore[misc]


def test_cached_views_follow_a_bucket_freed_and_refilled():
    """unpack/pack keep their views of a bucket tensor; a bucket whose storage is freed
    (resized to 0) and allocated again between calls must still be read and written
    where it is now, and copies of the layout carry no views."""
    import copy
    import pickle

    layout = compute_layout([(5, 3), (), (4,), (7, 2)], 2)
    bucket = torch.empty(layout.total_numel)
    storage = bucket.untyped_storage()
    for trial in range(3):
        storage.resize_(layout.total_numel * bucket.element_size())
        gathered = torch.randn(layout.total_numel, generator=torch.Generator().manual_seed(trial))
        layout.unpack(gathered, bucket)
        fresh = torch.empty(layout.total_numel)
        compute_layout([(5, 3), (), (4,), (7, 2)], 2).unpack(gathered, fresh)  # no cache
        assert torch.equal(bucket, fresh)
        sent, expected = torch.empty(layout.total_numel), torch.empty(layout.total_numel)
        layout.pack(bucket, sent)
        compute_layout([(5, 3), (), (4,), (7, 2)], 2).pack(fresh, expected)
        assert torch.equal(sent, expected)
        storage.resize_(0)
    assert layout._views  # the views were kept
    for other in (copy.deepcopy(layout), pickle.loads(pickle.dumps(layout))):
        assert other == layout and not other._views


# ---- whole placement (Note [whole placement]) ----------------------------------------------
whole_st = st.data()


def _whole_layout(data, shapes, shard_count, alignment):
    """A layout where a random subset of the parameters with a dim is whole-placed."""
    picks = [bool(sh) and data.draw(st.booleans()) for sh in shapes]
    sizes = [math.prod(sh) for sh, w in zip(shapes, picks, strict=True) if w]
    owned = iter(assign_owners(sizes, shard_count))
    owners = [next(owned) if w else None for w in picks]
    return compute_layout(shapes, shard_count, alignment, owners), owners


@settings(max_examples=150, deadline=None)
@given(shapes=shapes_st, shard_count=shard_count_st, alignment=alignment_st, data=whole_st)
def test_whole_slots_pack_unpack_and_place_every_element(shapes, shard_count, alignment, data):
    layout, owners = _whole_layout(data, shapes, shard_count, alignment)
    s = layout.shard_numel
    assert layout.used_numel == sum(math.prod(sh) for sh in shapes)
    g = torch.Generator().manual_seed(len(shapes) * 7 + shard_count)
    values = [torch.randn(sh, generator=g) for sh in shapes]
    pm = torch.zeros(layout.total_numel)
    for i, v in enumerate(values):
        pm[layout.param_offset(i) : layout.param_offset(i) + v.numel()] = v.reshape(-1)
    # Every parameter is contiguous and disjoint from the others in parameter-major space.
    spans = sorted((layout.param_offset(i), v.numel()) for i, v in enumerate(values))
    assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(spans))
    gathered = torch.empty(layout.total_numel)
    layout.pack(pm, gathered)
    for k in range(shard_count):
        shard = gathered[k * s : (k + 1) * s]
        alone = torch.full((s,), float("nan"))  # every element written
        layout.pack_rank(pm, k, alone)
        assert torch.equal(shard, alone)
        kept = torch.full((s,), float("nan"))
        layout.pack_rank(pm, k, kept, keep_views=True)  # whole slots: the per-slot copies
        assert torch.equal(shard, kept)
        for slot, v, owner in zip(layout.slots, values, owners, strict=True):
            assert slot.owner == owner
            r0, r1 = layout.local_rows(slot.index, k)
            if owner is not None:
                assert (r0, r1) == ((0, slot.rows) if k == owner else (0, 0))
            piece = v.reshape(-1) if slot.replicated else v[r0:r1].reshape(-1)
            start = layout.rank_offset(slot.index, k)
            assert torch.equal(shard[start : start + piece.numel()], piece)
        assert torch.count_nonzero(shard[layout.rank_used(k) :]) == 0
        back = torch.zeros(layout.total_numel)
        layout.unpack_rank(shard, k, back)
        for i, v in enumerate(values):
            r0, r1 = layout.local_rows(i, k)
            if layout.slots[i].replicated or r1 > r0:
                slot = layout.slots[i]
                start = layout.param_offset(i)
                if not (slot.whole or slot.replicated):
                    start += k * slot.width
                want = v.reshape(-1) if layout.slots[i].replicated else v[r0:r1].reshape(-1)
                assert torch.equal(back[start : start + want.numel()], want)
    out = torch.full((layout.total_numel,), float("nan"))
    layout.unpack(gathered, out)
    for i, v in enumerate(values):
        start = layout.param_offset(i)
        assert torch.equal(out[start : start + v.numel()], v.reshape(-1))


@settings(max_examples=50, deadline=None)
@given(shapes=shapes_st, data=whole_st)
def test_whole_slots_pack_unpack_coarse(shapes, data):
    """Coarse shards (each of C ranks owning N / C shards) read the same layout."""
    layout, _ = _whole_layout(data, shapes, 4, 4)
    values = [torch.randn(sh) for sh in shapes]
    pm = torch.zeros(layout.total_numel)
    for i, v in enumerate(values):
        pm[layout.param_offset(i) : layout.param_offset(i) + v.numel()] = v.reshape(-1)
    fine = torch.empty(layout.total_numel)
    layout.pack(pm, fine)
    coarse = torch.empty(layout.total_numel)
    layout.pack(pm, coarse, coarse=2)
    s = layout.shard_numel
    for rank in range(2):  # rank r owns shards r, r + 2
        mine = coarse[rank * 2 * s : (rank + 1) * 2 * s]
        want = torch.cat([fine[k * s : (k + 1) * s] for k in (rank, rank + 2)])
        assert torch.equal(mine, want)
    out = torch.zeros(layout.total_numel)
    layout.unpack(coarse, out, coarse=2)
    for i, v in enumerate(values):
        start = layout.param_offset(i)
        assert torch.equal(out[start : start + v.numel()], v.reshape(-1))


def test_whole_matrices_only_are_rank_major_and_balanced():
    shapes = [(8, 4), (4, 4), (4, 4), (2, 4)]
    owners = assign_owners([math.prod(sh) for sh in shapes], 2)
    assert owners == (0, 1, 1, 0)  # 32 + 8 | 16 + 16: greedy, largest first
    layout = compute_layout(shapes, 2, 4, owners)
    assert layout.is_rank_major()
    assert layout.shard_numel == 40 and layout.rank_used(0) == 40 and layout.rank_used(1) == 32
    assert [layout.param_offset(i) for i in range(4)] == [0, 40, 56, 32]
    assert layout.padding_numel == 8


def test_assign_owners_spreads_small_buckets_over_shards_by_prior_load():
    prior = [0, 0, 0, 0]
    seen = []
    for _ in range(4):  # four buckets of one matrix each, four shards
        (owner,) = assign_owners([16], 4, prior)
        prior[owner] += 16
        seen.append(owner)
    assert sorted(seen) == [0, 1, 2, 3]


def test_whole_placement_rejects_bad_owners():
    with pytest.raises(ValueError, match="cannot be owned whole"):
        compute_layout([()], 2, 1, [0])
    with pytest.raises(ValueError, match="cannot be owned whole"):
        compute_layout([(4, 4)], 2, 1, [2])
    with pytest.raises(ValueError, match="owners has 1 entries"):
        compute_layout([(4, 4), (2,)], 2, 1, [0])
    with pytest.raises(ValueError, match="must start at"):
        FlatLayout(
            slots=(ParamSlot(0, (2, 2), 1, 4, 2, 2, owner=0),),
            shard_count=2,
            shard_numel=8,
            alignment=1,
        )


@pytest.mark.cuda
@pytest.mark.parametrize("coarse", [None, 1, 2, 4, 8])
def test_unpack_on_the_test_device(coarse):
    """The copy-out on the test device (CUDA under ``--fsdp-device cuda``) puts every
    parameter back, for fine and coarse shards. A coarse copy-out reads its source
    transposed, dense but not row-major, which CUDA's ``split_with_sizes_copy`` reads as
    row-major (``UnpackTargets.copy`` copies it first)."""
    shapes = [(5, 3), (), (4,), (7, 2), (16,)]
    layout = compute_layout(shapes, 8, 4)
    values = [torch.randn(sh) for sh in shapes]
    pm = torch.zeros(layout.total_numel)
    for i, v in enumerate(values):
        pm[layout.param_offset(i) : layout.param_offset(i) + v.numel()] = v.reshape(-1)
    gathered = torch.empty(layout.total_numel)
    layout.pack(pm, gathered, coarse=coarse)
    out = torch.zeros(layout.total_numel, device=harness_device())
    layout.unpack(gathered.to(out.device), out, coarse=coarse)
    for i, v in enumerate(values):
        start = layout.param_offset(i)
        assert torch.equal(out[start : start + v.numel()].cpu(), v.reshape(-1)), (coarse, i)
