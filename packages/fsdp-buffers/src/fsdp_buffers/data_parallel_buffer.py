"""``DataParallelBuffer``: the storage of one parameter group in one dtype.

A buffer is either sharded (``is_data_distributed``: this rank keeps only its shard of
the flat layout, ``shard_numel`` elements) or replicated (this rank keeps the whole
padded buffer, ``total_numel`` elements, and its "shard" is a slice of it).

The unsharded data of a sharded buffer (its *bucket*) exists only while in use. Note
on how it is released: each sharded buffer owns one bucket tensor for its whole life,
and parameters' ``.data`` are views into it, created once. Fetching the bucket grows
its storage to full size; freeing it shrinks the storage to zero bytes. The views stay
valid objects throughout, and autograd's saved references to them see the re-gathered
data in backward, because the storage object never changes, only its allocation. This
is the same trick as PyTorch FSDP2's ``_alloc_storage``/``_free_storage``.

With ``fsdp_double_buffer``, the FSDP units' weight buckets live instead in two
persistent slots that consecutive units take turns in (``DoubleBufferAllocator``): no
allocation per step, at the price of the slots' memory staying reserved; each group
keeps a fixed slot and offset, so views are still created once. Root buckets and
gradient staging buckets stay temporary (see ``ParamAndGradBuffer``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from fsdp_buffers.layout import FlatLayout

__all__ = [
    "BucketAllocator",
    "DataParallelBuffer",
    "DoubleBufferAllocator",
    "TemporaryBucketAllocator",
]


class BucketAllocator:
    """Provides the unsharded storage of sharded buffers."""

    def bucket_for(self, buffer: DataParallelBuffer) -> torch.Tensor:
        """The buffer's bucket tensor: fixed for the buffer's life."""
        raise NotImplementedError

    def allocate(self, buffer: DataParallelBuffer) -> None:
        raise NotImplementedError

    def free(self, buffer: DataParallelBuffer) -> None:
        raise NotImplementedError

    def is_allocated(self, buffer: DataParallelBuffer) -> bool:
        raise NotImplementedError

    def can_allocate(self, buffer: DataParallelBuffer) -> bool:
        """Whether ``allocate(buffer)`` would succeed now."""
        return True

    def shares_slot(self, buffer: DataParallelBuffer, other: DataParallelBuffer) -> bool:
        """Whether ``other`` being allocated keeps ``buffer`` from being allocated."""
        return False

    def make_views(
        self, buffer: DataParallelBuffer, make: Callable[[torch.Tensor], list[torch.Tensor]]
    ) -> list[torch.Tensor]:
        """Create views into the bucket (bounds are checked against the storage, so
        the storage must be allocated while views are made)."""
        return make(self.bucket_for(buffer))


class TemporaryBucketAllocator(BucketAllocator):
    """Each bucket gets memory when fetched and gives it back when freed."""

    def __init__(self) -> None:
        self._buckets: dict[int, torch.Tensor] = {}

    def bucket_for(self, buffer: DataParallelBuffer) -> torch.Tensor:
        bucket = self._buckets.get(id(buffer))
        if bucket is None:
            bucket = torch.empty(
                buffer.layout.total_numel, dtype=buffer.dtype, device=buffer.device
            )
            bucket.untyped_storage().resize_(0)
            self._buckets[id(buffer)] = bucket
        return bucket

    def allocate(self, buffer: DataParallelBuffer) -> None:
        bucket = self.bucket_for(buffer)
        storage = bucket.untyped_storage()
        nbytes = bucket.numel() * bucket.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def free(self, buffer: DataParallelBuffer) -> None:
        bucket = self._buckets.get(id(buffer))
        if bucket is not None:
            bucket.untyped_storage().resize_(0)

    def is_allocated(self, buffer: DataParallelBuffer) -> bool:
        bucket = self._buckets.get(id(buffer))
        return bucket is not None and bucket.untyped_storage().size() > 0

    def make_views(
        self, buffer: DataParallelBuffer, make: Callable[[torch.Tensor], list[torch.Tensor]]
    ) -> list[torch.Tensor]:
        was_allocated = self.is_allocated(buffer)
        self.allocate(buffer)
        try:
            return make(self.bucket_for(buffer))
        finally:
            if not was_allocated:
                self.free(buffer)


class DoubleBufferAllocator(BucketAllocator):
    """Two persistent slots; the buckets of slot key k use slot ``k % 2``.

    Buffers are registered with a slot key (the hook layer uses the FSDP unit index, so
    consecutive units alternate) before their first fetch; a slot is sized to the
    largest total bytes registered under either parity. Fetching a bucket whose slot
    is still held by a bucket of another key is an error, never silent corruption.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._keys: dict[int, int] = {}  # id(buffer) -> slot key
        self._offsets: dict[int, int] = {}  # id(buffer) -> byte offset within its slot
        self._key_bytes: dict[int, int] = {}
        self._slots: list[torch.Tensor] | None = None
        self._buckets: dict[int, torch.Tensor] = {}
        self._holders: list[set[int]] = [set(), set()]  # slot -> keys holding it
        self._allocated: set[int] = set()

    def register(self, buffer: DataParallelBuffer, slot_key: int) -> None:
        if self._slots is not None:
            raise RuntimeError(
                "DoubleBufferAllocator: register every buffer before the first fetch"
            )
        used = self._key_bytes.get(slot_key, 0)
        align = 256  # bytes: every dtype's views start aligned
        used = math.ceil(used / align) * align
        self._keys[id(buffer)] = slot_key
        self._offsets[id(buffer)] = used
        self._key_bytes[slot_key] = used + buffer.layout.total_numel * buffer.element_size

    def _ensure_slots(self) -> None:
        if self._slots is None:
            sizes = [0, 0]
            for key, nbytes in self._key_bytes.items():
                sizes[key % 2] = max(sizes[key % 2], nbytes)
            self._slots = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]

    def bucket_for(self, buffer: DataParallelBuffer) -> torch.Tensor:
        bucket = self._buckets.get(id(buffer))
        if bucket is None:
            if id(buffer) not in self._keys:
                raise RuntimeError(
                    "DoubleBufferAllocator: buffer was not registered with a slot key"
                )
            self._ensure_slots()
            assert self._slots is not None
            slot = self._slots[self._keys[id(buffer)] % 2]
            start = self._offsets[id(buffer)]
            nbytes = buffer.layout.total_numel * buffer.element_size
            bucket = slot[start : start + nbytes].view(buffer.dtype)
            self._buckets[id(buffer)] = bucket
        return bucket

    def allocate(self, buffer: DataParallelBuffer) -> None:
        self.bucket_for(buffer)
        key = self._keys[id(buffer)]
        holders = self._holders[key % 2]
        others = holders - {key}
        if others:
            raise RuntimeError(
                f"fsdp_double_buffer: slot {key % 2} is still held by unit(s) {sorted(others)} "
                f"while unit {key} is fetched; release them first (at most two units can be "
                f"unsharded at once with double buffering)"
            )
        holders.add(key)
        self._allocated.add(id(buffer))

    def free(self, buffer: DataParallelBuffer) -> None:
        if id(buffer) not in self._allocated:
            return
        self._allocated.discard(id(buffer))
        key = self._keys[id(buffer)]
        if not any(self._keys[b] == key for b in self._allocated):
            self._holders[key % 2].discard(key)

    def is_allocated(self, buffer: DataParallelBuffer) -> bool:
        return id(buffer) in self._allocated

    def can_allocate(self, buffer: DataParallelBuffer) -> bool:
        key = self._keys[id(buffer)]
        return not (self._holders[key % 2] - {key})

    def shares_slot(self, buffer: DataParallelBuffer, other: DataParallelBuffer) -> bool:
        key, other_key = self._keys.get(id(buffer)), self._keys.get(id(other))
        return (
            key is not None
            and other_key is not None
            and key != other_key
            and (key % 2 == other_key % 2)
        )


class DataParallelBuffer:
    """The storage of one group in one dtype, sharded or replicated."""

    def __init__(
        self,
        layout: FlatLayout,
        *,
        dtype: torch.dtype,
        device: torch.device,
        is_data_distributed: bool,
        shard_rank: int,
        allocator: BucketAllocator | None = None,
        name: str = "",
    ) -> None:
        if not 0 <= shard_rank < layout.shard_count:
            raise ValueError(
                f"shard_rank {shard_rank} is outside the layout's {layout.shard_count} shards"
            )
        self.layout = layout
        self.dtype = dtype
        self.device = device
        self.is_data_distributed = is_data_distributed
        self.shard_rank = shard_rank
        self.name = name
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.allocator = allocator if allocator is not None else TemporaryBucketAllocator()
        self._shard_start, self._shard_end = layout.shard_bounds(shard_rank)
        numel = layout.shard_numel if is_data_distributed else layout.total_numel
        # Zeroed, so that padding never carries garbage into a reduction or a norm.
        self.data = torch.zeros(numel, dtype=dtype, device=device)

    # ---- shards -------------------------------------------------------------------
    @property
    def local_shard(self) -> torch.Tensor:
        """This rank's shard: the whole storage if sharded, a slice of it if not."""
        if self.is_data_distributed:
            return self.data
        return self.data[self._shard_start : self._shard_end]

    def local_param_view(self, index: int) -> torch.Tensor:
        """This rank's rows of parameter ``index``: shape (rows owned, *shape[1:])."""
        slot = self.layout.slots[index]
        start, end = self.layout.local_span(index, self.shard_rank)
        r0, r1 = self.layout.local_rows(index, self.shard_rank)
        base = self._shard_start if self.is_data_distributed else 0
        if start == end:  # owns nothing of this parameter
            start = end = min(max(self._shard_start, slot.offset), self._shard_end)
        flat = self.data[start - base : end - base]
        return flat.view(_rows_shape(slot.shape, r1 - r0))

    # ---- unsharded data -------------------------------------------------------------
    @property
    def has_unsharded_data(self) -> bool:
        return not self.is_data_distributed or self.allocator.is_allocated(self)

    def unsharded_tensor(self) -> torch.Tensor:
        """The tensor that holds (or will hold, once fetched) all of the data."""
        if not self.is_data_distributed:
            return self.data
        return self.allocator.bucket_for(self)

    def fetch_bucket(self) -> torch.Tensor:
        """Make room for the unsharded data and return it. Communication is the
        caller's: a sharded buffer's bucket holds garbage until it is gathered."""
        if self.is_data_distributed:
            self.allocator.allocate(self)
        return self.unsharded_tensor()

    def free_bucket(self) -> None:
        """Release the unsharded data of a sharded buffer (no-op when replicated)."""
        if self.is_data_distributed:
            self.allocator.free(self)

    def param_view(self, unsharded: torch.Tensor, index: int) -> torch.Tensor:
        slot = self.layout.slots[index]
        return unsharded[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def param_views(self) -> list[torch.Tensor]:
        """A view of every parameter into the unsharded tensor. For a sharded buffer
        they stay valid across fetch and free (same storage object)."""

        def make(unsharded: torch.Tensor) -> list[torch.Tensor]:
            return [self.param_view(unsharded, i) for i in range(len(self.layout.slots))]

        if not self.is_data_distributed:
            return make(self.data)
        return self.allocator.make_views(self, make)

    # ---- filling ----------------------------------------------------------------------
    def load_params(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy full parameter values into this buffer (only the local rows when
        sharded). Values are cast to the buffer's dtype."""
        if len(tensors) != len(self.layout.slots):
            raise ValueError(
                f"{self.name}: got {len(tensors)} tensors for {len(self.layout.slots)} parameters"
            )
        with torch.no_grad():
            for i, t in enumerate(tensors):
                if self.is_data_distributed:
                    r0, r1 = self.layout.local_rows(i, self.shard_rank)
                    if r1 > r0:
                        self.local_param_view(i).copy_(_rows(t, r0, r1))
                else:
                    self.param_view(self.data, i).copy_(t)

    @property
    def nbytes(self) -> int:
        """Bytes of persistent storage (not counting a fetched bucket)."""
        return self.data.numel() * self.element_size

    def __repr__(self) -> str:
        kind = "sharded" if self.is_data_distributed else "replicated"
        return (
            f"DataParallelBuffer({self.name!r}, {kind}, dtype={self.dtype}, "
            f"params={len(self.layout.slots)}, numel={self.data.numel()})"
        )


def _rows_shape(shape: tuple[int, ...], rows: int) -> tuple[int, ...]:
    if len(shape) == 0:
        return () if rows == 1 else (0,)
    return (rows, *shape[1:])


def _rows(t: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    if t.dim() == 0:
        return t
    return t[r0:r1]
