"""Named scratch allocations reused across steps, so temporary buffers are not reallocated.

Frameworks need temporary tensors every step (Megatron-Core's sequence-parallel
gathers, a gradient cast to the communication dtype). Allocating them anew each time
churns the caching allocator and fragments memory; :class:`GlobalMemoryBuffer` keeps one
flat allocation per ``(name, dtype)`` and hands out views of it. fsdp's own gathered
and staging buckets do not come from here: their lifetimes are managed by the bucket
allocators of ``data_parallel_buffer`` (temporary, or the persistent double buffer).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch

from fsdp_mesh import current_device

__all__ = ["GlobalMemoryBuffer", "get_global_memory_buffer"]


class GlobalMemoryBuffer:
    """Flat scratch allocations kept under ``(name, dtype)`` and reused by later requests.

    :meth:`get_tensor` returns a view of the requested shape into the allocation for
    ``(name, dtype)``. A request that fits reuses the allocation (same ``data_ptr``); a
    larger one replaces it with an allocation of exactly the new size, which later,
    smaller requests then reuse. The contents of a returned tensor are undefined.

    Callers must not use the same name concurrently: two holders of views under one
    name share memory, and the second request overwrites (or, after growth, detaches
    from) what the first is using. Give each concurrent use its own name.

    Args:
        device: where allocations live. ``None`` (the default) means the device this
            process computes on, resolved at each allocation: the current CUDA device
            when CUDA is available, else the CPU. Resolving late matters because the
            process-wide buffer is often created before ``torch.cuda.set_device`` picks
            this rank's GPU.
    """

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        self._device = torch.device(device) if device is not None else None
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    @property
    def device(self) -> torch.device:
        """The device the next allocation will be made on."""
        return self._device if self._device is not None else current_device()

    def get_tensor(
        self,
        tensor_shape: Sequence[int] | torch.Size | int,
        dtype: torch.dtype,
        name: str,
        mem_alloc_context: Callable[[], AbstractContextManager[object]] | None = None,
    ) -> torch.Tensor:
        """Return a ``tensor_shape`` view of ``dtype`` into the allocation named ``name``.

        ``mem_alloc_context`` is called, and its context entered, around an allocation
        only (not on reuse); e.g. a CUDA memory pool context so the bytes come from a
        registered pool. ``None`` allocates in the default pool.
        """
        shape = _as_shape(tensor_shape)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(
                f"dtype must be a torch.dtype, got {dtype!r} of type {type(dtype).__name__}."
            )
        numel = math.prod(shape)
        key = (name, dtype)
        buffer = self._buffers.get(key)
        device = self.device
        if buffer is None or buffer.numel() < numel or buffer.device != device:
            # Drop the old allocation first so the allocator can reuse its bytes for the
            # new one; views handed out earlier keep their storage alive regardless.
            self._buffers.pop(key, None)
            buffer = None
            context = (
                mem_alloc_context() if mem_alloc_context is not None else contextlib.nullcontext()
            )
            with context:
                buffer = torch.empty(numel, dtype=dtype, device=device, requires_grad=False)
            self._buffers[key] = buffer
        return buffer[:numel].view(shape)

    def clear(self) -> None:
        """Drop every allocation (memory is freed once no view of it is alive)."""
        self._buffers.clear()

    def allocated_bytes(self) -> int:
        """Total bytes held by the current allocations."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def _as_shape(tensor_shape: Sequence[int] | torch.Size | int) -> tuple[int, ...]:
    dims = (tensor_shape,) if isinstance(tensor_shape, numbers.Integral) else tensor_shape
    try:
        # operator.index takes ints, numpy ints and SymInts, and refuses floats.
        shape = tuple(operator.index(d) for d in dims)  # type: ignore[union-attr]
    except TypeError:
        shape = None
    if shape is None or any(d < 0 for d in shape) or any(isinstance(d, bool) for d in dims):  # type: ignore[union-attr]
        raise ValueError(
            f"tensor_shape must be a sequence of non-negative ints (or a torch.Size, or one "
            f"int), got {tensor_shape!r}."
        )
    return shape


_GLOBAL_MEMORY_BUFFER: GlobalMemoryBuffer | None = None
_GLOBAL_MEMORY_BUFFER_LOCK = threading.Lock()


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    """Return the process-wide :class:`GlobalMemoryBuffer` (created on first use)."""
    global _GLOBAL_MEMORY_BUFFER
    buffer = _GLOBAL_MEMORY_BUFFER
    if buffer is None:
        with _GLOBAL_MEMORY_BUFFER_LOCK:  # two threads racing here must get one buffer
            if _GLOBAL_MEMORY_BUFFER is None:
                _GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()
            buffer = _GLOBAL_MEMORY_BUFFER
    return buffer
