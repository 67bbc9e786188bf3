import contextlib
import re
import threading

import numpy as np
import pytest
import torch

from fsdp_buffers import memory_pool
from fsdp_buffers.memory_pool import GlobalMemoryBuffer, get_global_memory_buffer


class CountingContext:
    """A mem_alloc_context factory that counts how often an allocation is wrapped."""

    def __init__(self):
        self.entered = 0
        self.active = False

    @contextlib.contextmanager
    def __call__(self):
        self.entered += 1
        self.active = True
        try:
            yield
        finally:
            self.active = False


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_returns_a_view_of_the_requested_shape_and_dtype_on_cpu():
    buf = GlobalMemoryBuffer(device="cpu")
    t = buf.get_tensor((2, 3), torch.float32, "a")
    assert t.shape == (2, 3)
    assert t.dtype == torch.float32
    assert t.device == torch.device("cpu")
    assert t.is_contiguous()
    assert not t.requires_grad


def test_same_name_reuses_the_allocation():
    buf = GlobalMemoryBuffer(device="cpu")
    first = buf.get_tensor((4, 4), torch.float32, "gather")
    second = buf.get_tensor((4, 4), torch.float32, "gather")
    assert second.data_ptr() == first.data_ptr()
    # A smaller shape fits: same allocation, viewed from its start.
    third = buf.get_tensor((3,), torch.float32, "gather")
    assert third.data_ptr() == first.data_ptr()
    assert third.shape == (3,)
    # Views share memory: what one writes, the other reads.
    first.fill_(7.0)
    assert third.tolist() == [7.0, 7.0, 7.0]


def test_larger_request_grows_and_later_smaller_requests_reuse_the_grown_storage():
    buf = GlobalMemoryBuffer(device="cpu")
    small = buf.get_tensor((8,), torch.float32, "g")
    big = buf.get_tensor((16, 4), torch.float32, "g")
    assert _storage_ptr(big) != _storage_ptr(small)  # `small` keeps the old storage alive
    assert big.untyped_storage().nbytes() == 64 * 4
    assert small.untyped_storage().nbytes() == 8 * 4
    again = buf.get_tensor((10,), torch.float32, "g")
    assert again.data_ptr() == big.data_ptr()
    assert buf.allocated_bytes() == 64 * 4


def test_different_names_and_dtypes_are_independent():
    buf = GlobalMemoryBuffer(device="cpu")
    a = buf.get_tensor((4,), torch.float32, "a")
    b = buf.get_tensor((4,), torch.float32, "b")
    a16 = buf.get_tensor((4,), torch.bfloat16, "a")
    ptrs = {_storage_ptr(a), _storage_ptr(b), _storage_ptr(a16)}
    assert len(ptrs) == 3
    # Growing one does not touch the others.
    buf.get_tensor((100,), torch.float32, "a")
    assert buf.get_tensor((4,), torch.float32, "b").data_ptr() == b.data_ptr()
    assert buf.get_tensor((4,), torch.bfloat16, "a").data_ptr() == a16.data_ptr()
    assert buf.allocated_bytes() == 100 * 4 + 4 * 4 + 4 * 2


def test_mem_alloc_context_is_entered_exactly_once_per_allocation():
    buf = GlobalMemoryBuffer(device="cpu")
    ctx = CountingContext()
    seen_active = []

    def factory():
        seen_active.append(True)
        return ctx()

    buf.get_tensor((4,), torch.float32, "x", mem_alloc_context=factory)  # allocate
    buf.get_tensor((4,), torch.float32, "x", mem_alloc_context=factory)  # reuse
    buf.get_tensor((2,), torch.float32, "x", mem_alloc_context=factory)  # reuse
    assert ctx.entered == 1
    buf.get_tensor((8,), torch.float32, "x", mem_alloc_context=factory)  # grow
    assert ctx.entered == 2
    buf.get_tensor((8,), torch.bfloat16, "x", mem_alloc_context=factory)  # new dtype
    assert ctx.entered == 3
    assert len(seen_active) == 3
    assert not ctx.active  # exited after each allocation


def test_mem_alloc_context_wraps_the_allocation_itself(monkeypatch):
    buf = GlobalMemoryBuffer(device="cpu")
    ctx = CountingContext()
    active_during_empty = []
    real_empty = torch.empty

    def spy_empty(*args, **kwargs):
        active_during_empty.append(ctx.active)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(memory_pool.torch, "empty", spy_empty)
    buf.get_tensor((4,), torch.float32, "x", mem_alloc_context=ctx)
    assert active_during_empty == [True]


@pytest.mark.parametrize(
    ("shape", "expected"),
    [((), ()), (5, (5,)), (torch.Size([2, 3]), (2, 3)), ([2, 0], (2, 0)), ((np.int64(3),), (3,))],
)
def test_accepted_shapes(shape, expected):
    t = GlobalMemoryBuffer(device="cpu").get_tensor(shape, torch.float32, "s")
    assert tuple(t.shape) == expected


@pytest.mark.parametrize("shape", [(-1, 2), (2.0,), "ab", None, (True,)])
def test_bad_shapes_are_rejected_with_the_shape_in_the_message(shape):
    with pytest.raises(
        ValueError, match=re.escape("tensor_shape must be a sequence of non-negative ints")
    ):
        GlobalMemoryBuffer(device="cpu").get_tensor(shape, torch.float32, "s")


def test_bad_dtype_is_rejected():
    with pytest.raises(TypeError, match=re.escape("dtype must be a torch.dtype, got 'float32'")):
        GlobalMemoryBuffer(device="cpu").get_tensor((2,), "float32", "s")


def test_clear_drops_allocations():
    buf = GlobalMemoryBuffer(device="cpu")
    ctx = CountingContext()
    buf.get_tensor((4,), torch.float32, "x", mem_alloc_context=ctx)
    buf.clear()
    assert buf.allocated_bytes() == 0
    buf.get_tensor((4,), torch.float32, "x", mem_alloc_context=ctx)
    assert ctx.entered == 2


def test_default_device_is_resolved_at_allocation():
    buf = GlobalMemoryBuffer()
    expected = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    assert buf.device == expected
    assert buf.get_tensor((2,), torch.float32, "d").device == expected


def test_default_device_follows_the_current_device(monkeypatch):
    # The buffer is often created before torch.cuda.set_device picks this rank's GPU;
    # a later change of current device must not keep serving the old device's memory.
    buf = GlobalMemoryBuffer()
    monkeypatch.setattr(memory_pool, "current_device", lambda: torch.device("cpu"))
    t = buf.get_tensor((4,), torch.float32, "x")
    monkeypatch.setattr(memory_pool, "current_device", lambda: torch.device("meta"))
    moved = buf.get_tensor((4,), torch.float32, "x")
    assert moved.device == torch.device("meta")
    assert t.device == torch.device("cpu")


def test_explicit_device_is_kept(monkeypatch):
    buf = GlobalMemoryBuffer(device="meta")
    monkeypatch.setattr(memory_pool, "current_device", lambda: torch.device("cpu"))
    assert buf.device == torch.device("meta")
    assert buf.get_tensor((4,), torch.float32, "x").device == torch.device("meta")


def test_an_accelerator_without_an_index_is_its_current_device(monkeypatch):
    # An allocation on "cuda" reports "cuda:0", and torch.device("cuda") != that: the
    # buffer compared them as given and allocated anew at every request.
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda")
    )
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 3)
    buf = GlobalMemoryBuffer(device="cuda")
    assert buf.device == torch.device("cuda", 3)
    # At each allocation, as torch.empty(device="cuda") resolves it (set_device may
    # come after the buffer is made).
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 1)
    assert buf.device == torch.device("cuda", 1)
    assert GlobalMemoryBuffer(device="cuda:2").device == torch.device("cuda", 2)
    assert GlobalMemoryBuffer(device="cpu").device == torch.device("cpu")
    assert GlobalMemoryBuffer(device="meta").device == torch.device("meta")
    # Not this process's accelerator: left as given, for the allocation to refuse.
    assert GlobalMemoryBuffer(device="xpu").device == torch.device("xpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_without_an_index_reuses_the_allocation():
    buf = GlobalMemoryBuffer(device="cuda")
    first = buf.get_tensor((4, 4), torch.float32, "x")
    assert buf.get_tensor((4, 4), torch.float32, "x").data_ptr() == first.data_ptr()
    assert first.device == buf.device == torch.device("cuda", torch.cuda.current_device())


def test_global_buffer_is_one_per_process(monkeypatch):
    monkeypatch.setattr(memory_pool, "_GLOBAL_MEMORY_BUFFER", None)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(get_global_memory_buffer()))
        for _ in range(8)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len({id(b) for b in results}) == 1
    assert get_global_memory_buffer() is results[0]
    assert isinstance(results[0], GlobalMemoryBuffer)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_mem_pool_context():
    pool = torch.cuda.MemPool()
    buf = GlobalMemoryBuffer()
    t = buf.get_tensor(
        (1024,), torch.float32, "pool", mem_alloc_context=lambda: torch.cuda.use_mem_pool(pool)
    )
    assert t.is_cuda
    segments = pool.snapshot()
    assert sum(s["total_size"] for s in segments) >= 1024 * 4
