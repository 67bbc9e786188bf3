"""Host staging buffers: a copy of this rank's state that training cannot change.

An asynchronous save writes from a copy taken at the call, because training goes on
modifying the live tensors (the optimizer steps in place, on CPU as on CUDA). The copy
is one host buffer per tensor of the state dict, keyed by its place in the state dict
(``("model", "fc.weight")``) and kept from one save to the next: a save whose tensors
have the same shapes and dtypes as the previous one allocates nothing, it only copies.
On CUDA the buffers are pinned and filled with non-blocking copies on the current
stream, which is then synchronised (the values are those the stream had computed when
the save was called).

Only this rank's data is copied: a DTensor's local tensor (a ``RowShards``' own shard,
not the flat buffer it views), rebuilt around the copy with the same mesh, placements,
global shape and row offsets, so DCP plans and writes the copy exactly as it would the
live state; a tensor reached under two names (tied weights) is copied once. Non-tensor
leaves (param-group hyperparameters) are deep-copied.

``HostStager`` is also a DCP ``AsyncStager``: ``dcp.async_save(state,
checkpoint_id=..., async_stager=stager)`` stages with it (keep the stager for the next
save, and wait for a save's future before the next one: the buffers are reused).
``dcp.async_save``'s default stager works on fsdp's state dicts too (every DTensor's
local tensor owns its storage from offset 0: Note [picklable views] in
``fsdp_buffers.dtensor_views``), but allocates a fresh copy at every save; this one
allocates once, pinned on CUDA.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from fsdp_ckpt.row_shards import RowShards

__all__ = ["HostStager", "staging_bytes"]

Path_ = tuple[Any, ...]


def _leaves(value: Any, where: Path_ = ()) -> list[tuple[Path_, torch.Tensor]]:
    """Every plain tensor to copy in ``value``, with its place (a DTensor's local
    tensor, each shard of a ``LocalShardsWrapper``); one reached twice (tied weights)
    is listed twice."""
    if isinstance(value, DTensor):
        local = value._local_tensor
        if isinstance(local, LocalShardsWrapper):
            return [((*where, "shard", i), s) for i, s in enumerate(local.local_shards())]
        return [((*where, "local"), local)]
    if isinstance(value, torch.Tensor):
        return [(where, value)]
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, (*where, k))]
    if isinstance(value, list | tuple):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, (*where, i))]
    return []


def staging_bytes(state: Any) -> int:
    """Bytes of host memory ``HostStager`` keeps to stage ``state``: one copy of this
    rank's tensors (not of the buffers they view)."""
    unique = {_memory_of(t): t for _w, t in _leaves(state)}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _memory_of(t: torch.Tensor) -> tuple[Any, ...]:
    """What identifies the memory ``t`` reads: equal for two views of one weight (a tied
    weight under its two names); empty tensors are all different."""
    if t.numel() == 0:
        return ("empty", id(t))
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


@dataclass(frozen=True)
class _Wrapped:
    """A staged DTensor and what it was built from."""

    spec: Any
    offsets: Any
    copies: list[torch.Tensor]
    dtensor: DTensor


class HostStager(AsyncStager):
    """Copies state dicts into host buffers it keeps (see the module note). Not
    thread-safe: one owner (a process's asynchronous saver, or the caller of
    ``dcp.async_save``) calls ``stage``, and only once the previous save's background
    write has finished with the buffers."""

    _synchronize_after_execute = False  # ``stage`` returns a complete copy

    def __init__(self) -> None:
        self._buffers: dict[Path_, torch.Tensor] = {}
        self._wrappers: dict[Path_, _Wrapped] = {}
        self.allocations = 0  # buffers allocated so far (tests: no more after the first save)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def close(self) -> None:
        """Free the buffers (the next ``stage`` allocates them again)."""
        self._buffers.clear()
        self._wrappers.clear()

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once the copy is complete."""

    def _buffer(self, where: Path_, source: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(where)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            pin = source.device.type == "cuda"
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pin)
            self.allocations += 1
        return buffer

    @torch.no_grad()
    def stage(self, state: Any) -> Any:
        """A copy of ``state`` in this stager's host buffers, complete on return."""
        used: dict[Path_, torch.Tensor] = {}
        devices: set[torch.device] = set()
        copied: dict[tuple[Any, ...], torch.Tensor] = {}  # source memory -> its copy
        wrappers: dict[Path_, _Wrapped] = {}

        def copy_of(where: Path_, source: torch.Tensor) -> torch.Tensor:
            memory = _memory_of(source)
            if memory in copied:  # a tied weight, under its second name: one copy
                return copied[memory]
            buffer = copied[memory] = self._buffer(where, source)
            non_blocking = source.device.type == "cuda"
            buffer.copy_(source.detach(), non_blocking=non_blocking)
            if non_blocking:
                devices.add(source.device)
            used[where] = buffer
            return buffer

        def walk(value: Any, where: Path_) -> Any:
            if isinstance(value, DTensor):
                local = value._local_tensor
                offsets = None
                if isinstance(local, LocalShardsWrapper):
                    offsets = local.local_offsets()
                    copies = [
                        copy_of((*where, "shard", i), s) for i, s in enumerate(local.local_shards())
                    ]
                else:
                    copies = [copy_of((*where, "local"), local)]
                # The previous save's wrapper when it wraps the same buffers the same way
                # (building a RowShards costs more than copying a small tensor).
                hit = self._wrappers.get(where)
                if (
                    hit is None
                    or hit.offsets != offsets
                    or len(hit.copies) != len(copies)
                    or any(a is not b for a, b in zip(hit.copies, copies, strict=False))
                    or not (hit.spec is value._spec or hit.spec == value._spec)
                ):
                    staged = RowShards(copies, offsets) if offsets is not None else copies[0]
                    # Not from_local: it would move a host copy back to the mesh's device.
                    hit = _Wrapped(
                        value._spec,
                        offsets,
                        copies,
                        DTensor(staged, value._spec, requires_grad=False),
                    )
                wrappers[where] = hit
                return hit.dtensor
            if isinstance(value, torch.Tensor):
                return copy_of(where, value)
            if isinstance(value, dict):
                return {k: walk(v, (*where, k)) for k, v in value.items()}
            if isinstance(value, list | tuple):
                return type(value)(walk(v, (*where, i)) for i, v in enumerate(value))
            return copy.deepcopy(value)

        staged = walk(state, ())
        for device in devices:  # the non-blocking copies have landed
            torch.cuda.current_stream(device).synchronize()
        self._buffers = used  # entries no longer in the state dict are freed
        self._wrappers = wrappers
        return staged
