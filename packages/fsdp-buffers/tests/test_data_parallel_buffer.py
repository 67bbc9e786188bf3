"""DataParallelBuffer on its own (single process): layouts for N=4 shards, with each
``shard_rank`` built directly, so every rank's view is checked without communication."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Shard

from fsdp_buffers.data_parallel_buffer import (
    DataParallelBuffer,
    DoubleBufferAllocator,
    TemporaryBucketAllocator,
)
from fsdp_buffers.slot_placement import compute_layout

N = 4
# Odd shapes: a weight cut across shards, 1-d and 0-d params, an empty param, a 3-d one.
SHAPES = [(7, 5), (5,), (13, 3), (0, 3), (), (2, 3, 2), (3,)]


def _layout(alignment: int = 4):
    return compute_layout(SHAPES, N, alignment)


def _values(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _buffer(layout, rank, sharded, dtype=torch.float32, allocator=None):
    return DataParallelBuffer(
        layout,
        dtype=dtype,
        device=torch.device("cpu"),
        is_data_distributed=sharded,
        shard_rank=rank,
        allocator=allocator,
        name=f"test.r{rank}",
    )


def _gathered(layout, values, dtype=torch.float32):
    """What an all-gather would produce: every rank's shard, rank-major."""
    shards = []
    for rank in range(layout.shard_count):
        buf = _buffer(layout, rank, sharded=True, dtype=dtype)
        buf.load_params(values)
        shards.append(buf.data)
    return torch.cat(shards)


def _unsharded(layout, values, dtype=torch.float32):
    """The parameter-major buffer: the replicated buffer's data."""
    full = _buffer(layout, 0, sharded=False, dtype=dtype)
    full.load_params(values)
    return full.data


def _chunk(value, rank, n):
    """DTensor's ``Shard(0)`` piece of ``value`` on ``rank`` (torch's own arithmetic)."""
    size, offset = Shard.local_shard_size_and_offset(value.shape[0], n, rank)
    return value[offset : offset + size]


def test_layout_is_actually_sharded():
    layout = _layout()
    # The test is only meaningful if parameters are spread over several ranks.
    owners = {k for i in range(len(SHAPES)) for k in range(N) if layout.local_rows(i, k)[1] >
              layout.local_rows(i, k)[0] and SHAPES[i]}  # fmt: skip
    assert owners == set(range(N))
    assert any(len({layout.local_rows(i, k) for k in range(N)}) > 2 for i in range(len(SHAPES)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_storage_sizes(dtype):
    layout = _layout()
    for rank in range(N):
        sharded = _buffer(layout, rank, True, dtype)
        replicated = _buffer(layout, rank, False, dtype)
        assert sharded.data.numel() == layout.shard_numel
        assert replicated.data.numel() == layout.total_numel == N * layout.shard_numel
        assert sharded.nbytes == layout.shard_numel * dtype.itemsize
        assert replicated.nbytes == layout.total_numel * dtype.itemsize
        assert sharded.local_shard.data_ptr() == sharded.data.data_ptr()
        assert replicated.copy_local_shard().numel() == layout.shard_numel
        with pytest.raises(RuntimeError, match="replicated buffer is parameter-major"):
            replicated.local_shard  # noqa: B018
        assert torch.count_nonzero(sharded.data) == 0  # starts zeroed (padding stays clean)
        assert not sharded.has_unsharded_data and replicated.has_unsharded_data


def test_bad_shard_rank():
    with pytest.raises(ValueError, match="shard_rank 4 is outside the buffer's 4 shards"):
        _buffer(_layout(), N, True)


@pytest.mark.parametrize("sharded", [True, False])
def test_local_param_view_is_the_dtensor_chunk_for_every_rank(sharded):
    layout = _layout()
    values = _values()
    for rank in range(N):
        buf = _buffer(layout, rank, sharded)
        buf.load_params(values)
        for i, (shape, value) in enumerate(zip(SHAPES, values, strict=True)):
            view = buf.local_param_view(i)
            if shape:
                assert torch.equal(view, _chunk(value, rank, N))
                assert view.shape == (*_chunk(value, rank, N).shape,)
            else:  # 0-d: every rank holds it (Replicate)
                assert view.shape == () and torch.equal(view, value)
            # A view of the buffer: writes land in it.
            assert view.untyped_storage().data_ptr() == buf.data.untyped_storage().data_ptr()


def test_local_param_view_writes_reach_the_buffer():
    layout = _layout()
    for rank in range(N):
        sharded, replicated = _buffer(layout, rank, True), _buffer(layout, rank, False)
        for i in range(len(SHAPES)):
            sharded.local_param_view(i).fill_(i + 1)
            replicated.local_param_view(i).fill_(i + 1)
        # The same shard in both: written as views, read back packed.
        assert torch.equal(sharded.local_shard, replicated.copy_local_shard())
        assert torch.count_nonzero(replicated.data) == torch.count_nonzero(sharded.data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_params_replicated_is_parameter_major_and_casts(dtype):
    layout = _layout()
    values = _values()
    buf = _buffer(layout, 2, False, dtype)
    buf.load_params(values)
    used = torch.zeros(layout.total_numel, dtype=torch.bool)
    for slot, value in zip(layout.slots, values, strict=True):
        start = layout.param_offset(slot.index)
        flat = buf.data[start : start + slot.numel]
        assert torch.equal(flat, value.to(dtype).flatten())
        assert torch.equal(buf.param_view(buf.data, slot.index), value.to(dtype))
        used[start : start + slot.numel] = True
    assert torch.count_nonzero(buf.data[~used]) == 0  # padding stays zero
    assert int(used.sum()) == layout.used_numel


def test_load_params_sharded_holds_its_chunks_and_pack_agrees():
    layout = _layout()
    values = _values()
    full = _unsharded(layout, values)
    for rank in range(N):
        buf = _buffer(layout, rank, True)
        buf.load_params(values)
        packed = torch.empty(layout.shard_numel)
        layout.pack_rank(full, rank, packed)
        assert torch.equal(buf.data, packed)
        for slot, value in zip(layout.slots, values, strict=True):
            piece = value if slot.replicated else _chunk(value, rank, N)
            region = buf.data[slot.offset : slot.offset + slot.width]
            assert torch.equal(region[: piece.numel()], piece.reshape(-1))
            assert torch.count_nonzero(region[piece.numel() :]) == 0  # padded rows
    with pytest.raises(ValueError, match=r"got 2 tensors for 7 parameters"):
        buf.load_params(values[:2])


def test_fetch_and_free_release_memory_and_views_stay_valid():
    layout = _layout()
    values = _values()
    buf = _buffer(layout, 1, True)
    buf.load_params(values)
    views = buf.param_views()
    bucket = buf.unsharded_tensor()
    storage = bucket.untyped_storage()
    full_bytes = layout.total_numel * 4
    assert storage.size() == 0 and not buf.has_unsharded_data  # views made, memory not kept
    for view in views:
        assert view.untyped_storage().data_ptr() == storage.data_ptr()

    fetched = buf.fetch_bucket()
    assert fetched.data_ptr() == bucket.data_ptr() and buf.has_unsharded_data
    assert storage.size() == full_bytes == bucket.untyped_storage().nbytes()
    layout.unpack(_gathered(layout, values), fetched)  # stands in for the all-gather
    for view, value in zip(views, values, strict=True):
        assert torch.equal(view, value)

    buf.free_bucket()
    assert bucket.untyped_storage().size() == 0 and not buf.has_unsharded_data
    for view in views:
        assert view.untyped_storage().size() == 0  # the views' memory really is gone
    buf.free_bucket()  # idempotent

    # Re-fetch: the same view objects see the new data (same storage object, new memory).
    new_values = [v + 1 for v in values]
    layout.unpack(_gathered(layout, new_values), buf.fetch_bucket())
    assert storage.size() == full_bytes
    for view, value in zip(views, new_values, strict=True):
        assert torch.equal(view, value)
    # The sharded data itself was never touched by any of this.
    assert torch.equal(
        buf.data, _gathered(layout, values)[: layout.shard_numel * 2][-layout.shard_numel :]
    )
    buf.free_bucket()


def test_coarse_buffers_own_strided_pieces_and_unpack_whole_parameters():
    """Fully-sharded hybrid sharding: 2 coarse ranks over 4 pieces; coarse rank k owns
    pieces k and k + 2, and gathering the coarse shards unpacks to the parameters."""
    layout = _layout()
    values = _values()
    fine = [b for b in (_buffer(layout, k, True) for k in range(N))]
    for b in fine:
        b.load_params(values)
    coarse = []
    for k in range(2):
        buf = DataParallelBuffer(
            layout,
            dtype=torch.float32,
            device=torch.device("cpu"),
            is_data_distributed=True,
            shard_rank=k,
            coarse=2,
        )
        buf.load_params(values)
        assert buf.owned_shards == (k, k + 2)
        assert torch.equal(buf.data, torch.cat([fine[k].data, fine[k + 2].data]))
        coarse.append(buf)
    pm = torch.empty(layout.total_numel)
    layout.unpack(torch.cat([b.data for b in coarse]), pm, coarse=2)
    for i, value in enumerate(values):
        assert torch.equal(coarse[0].param_view(pm, i), value)
    back = torch.empty(layout.total_numel)
    layout.pack(pm, back, coarse=2)
    assert torch.equal(back, torch.cat([b.data for b in coarse]))
    with pytest.raises(RuntimeError, match="coarse shard holds several pieces"):
        coarse[0].local_param_view(0)


def test_views_made_while_fetched_leave_the_bucket_fetched():
    layout = _layout()
    buf = _buffer(layout, 0, True)
    buf.fetch_bucket()
    views = buf.param_views()
    assert buf.has_unsharded_data and views[0].untyped_storage().size() > 0
    buf.free_bucket()
    assert views[0].untyped_storage().size() == 0


def test_replicated_buffer_has_no_bucket_to_free():
    layout = _layout()
    values = _values()
    buf = _buffer(layout, 3, False)
    buf.load_params(values)
    assert buf.fetch_bucket() is buf.data and buf.unsharded_tensor() is buf.data
    views = buf.param_views()
    buf.free_bucket()
    assert buf.data.untyped_storage().size() == layout.total_numel * 4
    for view, value in zip(views, values, strict=True):
        assert torch.equal(view, value)


def test_each_buffer_has_its_own_bucket_with_a_shared_temporary_allocator():
    layout = _layout()
    alloc = TemporaryBucketAllocator()
    a, b = _buffer(layout, 0, True, allocator=alloc), _buffer(layout, 0, True, allocator=alloc)
    a.fetch_bucket().fill_(1.0)
    assert not b.has_unsharded_data
    b.fetch_bucket().fill_(2.0)
    assert torch.all(a.unsharded_tensor() == 1.0)
    a.free_bucket()
    assert b.has_unsharded_data and not a.has_unsharded_data


def _unit_buffers(alloc, units=4):
    # Units of different sizes, so that the slot size must be the maximum per parity.
    layouts = [compute_layout([(3 + u, 5)], N, 4) for u in range(units)]
    bufs = [_buffer(lay, 0, True, allocator=alloc) for lay in layouts]
    for u, b in enumerate(bufs):
        alloc.register(b, u)
    return bufs


def test_double_buffer_reuses_one_slot_per_parity():
    alloc = DoubleBufferAllocator(torch.device("cpu"))
    bufs = _unit_buffers(alloc)
    views = [b.param_views() for b in bufs]  # creating views allocates the slots
    assert all(b.unsharded_tensor().untyped_storage().size() > 0 for b in bufs)
    ptr = [b.fetch_bucket().data_ptr() for b in bufs[:2]]
    assert ptr[0] != ptr[1]
    bufs[0].fetch_bucket().fill_(0.0)
    bufs[1].fetch_bucket().fill_(1.0)
    bufs[0].free_bucket()
    bufs[1].free_bucket()
    assert bufs[2].fetch_bucket().data_ptr() == ptr[0]  # same parity, same slot
    assert bufs[3].fetch_bucket().data_ptr() == ptr[1]
    bufs[2].unsharded_tensor().fill_(2.0)
    # Unit 0's views were made once and now see unit 2's data: one slot, no new memory.
    assert torch.all(views[0][0] == 2.0) and torch.all(views[1][0] == 1.0)
    # Each slot is sized for the largest unit of its parity (units 2 and 3 here).
    slot_bytes = [s.numel() for s in alloc._slots]
    assert slot_bytes == [bufs[2].layout.total_numel * 4, bufs[3].layout.total_numel * 4]


def test_double_buffer_refuses_a_slot_that_is_still_held():
    alloc = DoubleBufferAllocator(torch.device("cpu"))
    bufs = _unit_buffers(alloc)
    bufs[0].fetch_bucket()
    bufs[1].fetch_bucket()  # other parity: fine
    with pytest.raises(RuntimeError, match=r"slot 0 is still held by unit\(s\) \[0\] while unit 2"):
        bufs[2].fetch_bucket()
    assert not bufs[2].has_unsharded_data and bufs[0].has_unsharded_data
    bufs[0].free_bucket()
    bufs[2].fetch_bucket()
    with pytest.raises(RuntimeError, match=r"slot 1 is still held by unit\(s\) \[1\] while unit 3"):
        bufs[3].fetch_bucket()


def test_double_buffer_shares_a_slot_between_buffers_of_one_unit():
    alloc = DoubleBufferAllocator(torch.device("cpu"))
    layout = _layout()
    weights = _buffer(layout, 0, True, allocator=alloc)
    grads = _buffer(layout, 0, True, dtype=torch.bfloat16, allocator=alloc)
    alloc.register(weights, 0)
    alloc.register(grads, 0)
    w, g = weights.fetch_bucket(), grads.fetch_bucket()  # same unit: both at once
    assert w.data_ptr() == alloc._slots[0].data_ptr()
    offset = g.data_ptr() - w.data_ptr()
    assert offset >= w.nbytes and offset % 256 == 0  # no overlap; offset aligned in the slot
    weights.free_bucket()
    assert alloc.is_allocated(grads) and alloc._holders[0] == {0}
    grads.free_bucket()
    assert alloc._holders[0] == set()


def test_double_buffer_registration_errors():
    alloc = DoubleBufferAllocator(torch.device("cpu"))
    bufs = _unit_buffers(alloc, units=2)
    stray = _buffer(_layout(), 0, True, allocator=alloc)
    with pytest.raises(RuntimeError, match="not registered with a slot key"):
        stray.fetch_bucket()
    bufs[0].fetch_bucket()
    with pytest.raises(RuntimeError, match="register every buffer before the first fetch"):
        alloc.register(stray, 5)


# ---- properties over shapes, dtypes and shard counts (hypothesis) -----------------------

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8]


@settings(max_examples=80, deadline=None)
@given(
    shapes=st.lists(
        st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple), min_size=1, max_size=8
    ),
    shard_count=st.integers(1, 8),
    dtype=st.sampled_from(_DTYPES),
)
def test_every_rank_holds_the_dtensor_chunks_of_every_dtype(shapes, shard_count, dtype):
    """In every dtype, with the default alignment: each shard starts on a 16-byte
    boundary of the gathered buffer; a rank's part of each parameter is DTensor's
    ``Shard(0)`` piece; and gathering then unpacking gives every parameter back
    bit-exactly, as packing gives the gathered shards back."""
    layout = compute_layout(shapes, shard_count)
    g = torch.Generator().manual_seed(len(shapes) * 31 + shard_count)
    values = [(torch.randn(s, generator=g) * 50).to(dtype) for s in shapes]
    shards = []
    for rank in range(shard_count):
        buf = _buffer(layout, rank, sharded=True, dtype=dtype)
        buf.load_params(values)
        start, _ = layout.shard_bounds(rank)
        assert (start * buf.element_size) % 16 == 0, (start, dtype)
        assert buf.data.numel() == layout.shard_numel
        shards.append(buf)
        for i, value in enumerate(values):
            piece = buf.local_param_view(i)
            want = value if value.dim() == 0 else _chunk(value, rank, shard_count)
            assert torch.equal(piece, want)
    gathered = torch.cat([b.data for b in shards])
    pm = torch.empty(layout.total_numel, dtype=dtype)
    layout.unpack(gathered, pm)
    for i, value in enumerate(values):
        assert torch.equal(shards[0].param_view(pm, i), value)
    back = torch.empty_like(gathered)
    layout.pack(pm, back)
    assert torch.equal(back, gathered)
