"""``DataParallelBuffer``: the storage of one parameter group in one dtype.

A buffer is either sharded (``is_data_distributed``: this rank keeps only its shard,
``shard_numel`` elements, rank-major) or replicated (this rank keeps the whole
parameter-major buffer, ``total_numel`` elements); see Note [shard layout] in ``layout``.

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

    # Whether a fetch takes memory that another bucket's fetch could take in the
    # meantime (a shared slot): such buckets are fetched when their gather starts, so
    # that the slot is reserved; others only when it lands (``Bucket.start_gather``).
    shares_memory: bool = False

    def bucket_for(self, buffer: DataParallelBuffer) -> torch.Tensor:
        """The buffer's bucket tensor: fixed for the buffer's life."""
        raise NotImplementedError

    def allocate(self, buffer: DataParallelBuffer) -> torch.Tensor:
        """Give the buffer's bucket memory; returns its bucket tensor (``bucket_for``)."""
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

    def allocate(self, buffer: DataParallelBuffer) -> torch.Tensor:
        bucket = self.bucket_for(buffer)
        storage = bucket.untyped_storage()
        nbytes = bucket.numel() * bucket.element_size()
        if storage.nbytes() != nbytes:  # nbytes: C; size() is a Python wrapper of it
            storage.resize_(nbytes)
        return bucket

    def free(self, buffer: DataParallelBuffer) -> None:
        bucket = self._buckets.get(id(buffer))
        if bucket is not None:
            bucket.untyped_storage().resize_(0)

    def is_allocated(self, buffer: DataParallelBuffer) -> bool:
        bucket = self._buckets.get(id(buffer))
        return bucket is not None and bucket.untyped_storage().nbytes() > 0

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

    shares_memory = True

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

    def allocate(self, buffer: DataParallelBuffer) -> torch.Tensor:
        bucket = self.bucket_for(buffer)
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
        return bucket

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
    """The storage of one group in one dtype, sharded or replicated (Note [shard layout]
    in ``layout``): a sharded buffer keeps this rank's shard (rank-major), a replicated
    one the whole parameter-major buffer, whose parameters are views."""

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
        coarse: int | None = None,
    ) -> None:
        # ``coarse``: the number of ranks the buffer is sharded over when each owns several
        # of the layout's shards (fully-sharded hybrid sharding; Note [shard layout]).
        self.coarse = layout.shard_count if coarse is None else coarse
        if self.coarse < 1 or layout.shard_count % self.coarse:
            raise ValueError(
                f"{name}: coarse={self.coarse} must divide the layout's {layout.shard_count} shards"
            )
        if not 0 <= shard_rank < self.coarse:
            raise ValueError(
                f"shard_rank {shard_rank} is outside the buffer's {self.coarse} shards"
            )
        self.layout = layout
        self.dtype = dtype
        self.device = device
        self.is_data_distributed = is_data_distributed
        self.shard_rank = shard_rank
        self.name = name
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.allocator = allocator if allocator is not None else TemporaryBucketAllocator()
        g = layout.shard_count // self.coarse
        # The layout's shards this rank owns, in the order they sit in its local shard.
        self.owned_shards = tuple(shard_rank + j * self.coarse for j in range(g))
        self.numel = g * layout.shard_numel if is_data_distributed else layout.total_numel
        # Zeroed, so that padding never carries garbage into a reduction or a norm.
        self._data: torch.Tensor | None = torch.zeros(self.numel, dtype=dtype, device=device)
        # Note [released storage]: a buffer whose storage was released (``release``) is
        # all zeros; the first reader re-materializes it (``_source``'s value for a
        # follower, a slice of another buffer, else zeros). Followers drop their derived
        # data whenever this buffer's storage changes.
        self._source: Callable[[], torch.Tensor] | None = None
        self._parent: DataParallelBuffer | None = None
        self._followers: list[DataParallelBuffer] = []

    # ---- storage ------------------------------------------------------------------
    @property
    def data(self) -> torch.Tensor:
        """The storage (this rank's shard when sharded); re-made as zeros on first
        access after ``release`` (Note [released storage])."""
        data = self._data
        if data is None:
            if self._source is not None:
                data = self._source()
            else:
                data = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
            self._data = data
        return data

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if value.dtype != self.dtype or value.shape != (self.numel,):
            raise ValueError(
                f"{self.name}: storage must be a flat {self.dtype} tensor of {self.numel} "
                f"elements; got {value.dtype} {tuple(value.shape)}"
            )
        self._set(value)

    def _set(self, value: torch.Tensor | None) -> None:
        self._data = value
        for follower in self._followers:
            follower._set(None)

    def release(self) -> None:
        """Drop this buffer's storage (and its followers'): its values are zeros from
        now on, re-made by the first reader. Nothing is freed under a tensor someone
        still holds (views of the old storage keep it alive and valid): the memory
        goes once the last of them does."""
        self._set(None)

    @property
    def is_released(self) -> bool:
        """Whether the storage was released and no one has read it since."""
        if self._data is not None:
            return False
        return self._parent is None or self._parent.is_released

    def follow(self, parent: DataParallelBuffer, derive: Callable[[torch.Tensor], torch.Tensor]):
        """Make this buffer's storage ``derive(parent.data)`` (a view), re-derived
        whenever the parent's storage changes (e.g. the fine slice of hybrid sharding's
        coarse main grads)."""
        self._parent = parent
        self._source = lambda: derive(parent.data)
        parent._followers.append(self)
        self._data = None

    def zero_(self) -> None:
        """Zero the storage; nothing to do when it is released (already zeros)."""
        if self._data is not None:
            self._data.zero_()
        elif self._parent is not None and not self._parent.is_released:
            self.data.zero_()

    # ---- shards -------------------------------------------------------------------
    @property
    def local_shard(self) -> torch.Tensor:
        """This rank's shard (rank-major): the storage of a sharded buffer. A replicated
        buffer holds no shard-shaped view of itself: use ``copy_local_shard`` /
        ``set_local_shard``."""
        if not self.is_data_distributed:
            raise RuntimeError(
                f"{self.name}: a replicated buffer is parameter-major; its local shard is a "
                "copy (copy_local_shard), not a view"
            )
        return self.data

    def copy_local_shard(self) -> torch.Tensor:
        """This rank's shard as a new contiguous tensor (a copy when replicated)."""
        if self.is_data_distributed:
            return self.data.clone()
        out = torch.empty(
            len(self.owned_shards) * self.layout.shard_numel, dtype=self.dtype, device=self.device
        )
        self._pack_owned(self.data, out, keep_views=True)
        return out

    def set_local_shard(self, shard: torch.Tensor) -> None:
        """Write ``shard`` (rank-major, this rank's) into the buffer; a replicated buffer
        keeps its other ranks' regions as they are."""
        if self.is_data_distributed:
            self.data.copy_(shard)
            return
        s = self.layout.shard_numel
        for j, k in enumerate(self.owned_shards):
            self.layout.unpack_rank(shard[j * s : (j + 1) * s], k, self.data)

    def _pack_owned(self, pm: torch.Tensor, out: torch.Tensor, keep_views: bool = False) -> None:
        s = self.layout.shard_numel
        for j, k in enumerate(self.owned_shards):
            self.layout.pack_rank(pm, k, out[j * s : (j + 1) * s], keep_views)

    def load_from_unsharded(self, pm: torch.Tensor) -> None:
        """Fill the buffer from a whole parameter-major tensor (its own shard of it when
        sharded)."""
        if self.is_data_distributed:
            self._pack_owned(pm, self.data)
        else:
            self.data.copy_(pm)

    def copy_shard_from(self, other: DataParallelBuffer) -> None:
        """Make this rank's part equal to ``other``'s (same layout; dtypes may differ):
        the shard when either is sharded, everything when both are replicated."""
        if self.is_data_distributed == other.is_data_distributed:
            self.data.copy_(other.data)
        elif self.is_data_distributed:
            self.data.copy_(other.copy_local_shard())
        else:
            self.set_local_shard(other.data)

    def local_param_view(self, index: int) -> torch.Tensor:
        """This rank's rows of parameter ``index`` (its ``torch.chunk`` piece): shape
        (rows owned, *shape[1:]); the element itself for a 0-d parameter; a whole-placed
        parameter whole on its owner, no rows elsewhere (Note [whole placement])."""
        if len(self.owned_shards) != 1:
            raise RuntimeError(
                f"{self.name}: a coarse shard holds several pieces of each parameter, not one view"
            )
        layout = self.layout
        slot = layout.slots[index]
        if slot.replicated:
            flat = (
                self.data[slot.offset : slot.offset + 1]
                if self.is_data_distributed
                else (self.data[layout.param_offset(index) : layout.param_offset(index) + 1])
            )
            return flat.view(())
        r0, r1 = layout.local_rows(index, self.shard_rank)
        n = (r1 - r0) * slot.row_numel
        if self.is_data_distributed:
            start = layout.rank_offset(index, self.shard_rank)
        elif slot.whole:
            start = layout.param_offset(index)
        else:
            start = layout.param_offset(index) + self.shard_rank * slot.width
        return self.data[start : start + n].view(_rows_shape(slot.shape, r1 - r0))

    # ---- unsharded data -------------------------------------------------------------
    @property
    def has_unsharded_data(self) -> bool:
        return not self.is_data_distributed or self.allocator.is_allocated(self)

    def unsharded_tensor(self) -> torch.Tensor:
        """The parameter-major tensor that holds (or will hold, once fetched) all of the
        data."""
        if not self.is_data_distributed:
            return self.data
        return self.allocator.bucket_for(self)

    def fetch_bucket(self) -> torch.Tensor:
        """Make room for the unsharded data and return it. Communication is the
        caller's: a sharded buffer's bucket holds garbage until it is gathered."""
        if not self.is_data_distributed:
            return self.data
        return self.allocator.allocate(self)

    def free_bucket(self) -> None:
        """Release the unsharded data of a sharded buffer (no-op when replicated)."""
        if self.is_data_distributed:
            self.allocator.free(self)

    def param_view(self, unsharded: torch.Tensor, index: int) -> torch.Tensor:
        slot = self.layout.slots[index]
        start = self.layout.param_offset(index)
        return unsharded[start : start + slot.numel].view(slot.shape)

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
        """Copy full parameter values into this buffer (only the local pieces when
        sharded). Values are cast to the buffer's dtype."""
        if len(tensors) != len(self.layout.slots):
            raise ValueError(
                f"{self.name}: got {len(tensors)} tensors for {len(self.layout.slots)} parameters"
            )
        layout = self.layout
        with torch.no_grad():
            for i, t in enumerate(tensors):
                if not self.is_data_distributed:
                    self.param_view(self.data, i).copy_(t)
                    continue
                slot = layout.slots[i]
                for j, k in enumerate(self.owned_shards):
                    r0, r1 = layout.local_rows(i, k)
                    start = j * layout.shard_numel + layout.rank_offset(i, k)
                    n = (r1 - r0) * slot.row_numel
                    if n:
                        self.data[start : start + n].copy_(_rows(t, r0, r1).reshape(-1))

    @property
    def nbytes(self) -> int:
        """Bytes of persistent storage (not counting a fetched bucket), whether or not
        it is allocated now (Note [released storage])."""
        return self.numel * self.element_size

    def __repr__(self) -> str:
        kind = "sharded" if self.is_data_distributed else "replicated"
        return (
            f"DataParallelBuffer({self.name!r}, {kind}, dtype={self.dtype}, "
            f"params={len(self.layout.slots)}, numel={self.numel})"
        )


def _rows_shape(shape: tuple[int, ...], rows: int) -> tuple[int, ...]:
    if len(shape) == 0:
        return () if rows == 1 else (0,)
    return (rows, *shape[1:])


def _rows(t: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    if t.dim() == 0:
        return t
    return t[r0:r1]
