"""Shard layout of a parameter group: DTensor's ``torch.chunk`` pieces, packed per rank.

Note [shard layout]. Every parameter is split along dim 0 into ``N`` (``shard_count``)
``torch.chunk``-sized pieces, exactly as DTensor's ``Shard(0)`` splits it: with ``R`` rows
and ``c = ceil(R / N)`` (``chunk_rows``), rank ``k`` holds rows
``[min(k*c, R), min((k+1)*c, R))``, possibly none. So the local tensor of every sharded
DTensor we hand out (parameters, gradients, optimizer state, state dicts) is the piece
DTensor's metadata says it is, and every torch tool that trusts that metadata (DCP,
``full_tensor()``, ``redistribute``, sharding propagation of ``mean``, ``std``, ...) is right.

Two index spaces hold the same elements:

* the *shard* (rank-major) space: rank ``k``'s shard is ``shard_numel`` elements, the
  concatenation of its piece of every parameter, each in a region of ``width = c *
  row_numel`` elements (zero-padded when the rank holds fewer than ``c`` rows), back to
  back from ``offset``; the shard ends with padding up to a multiple of ``alignment``. An
  all-gather of the shards is ``(N, shard_numel)``, rank-major; a reduce-scatter takes it.
* the *parameter-major* (unsharded) space: parameter ``i``'s ``N`` regions back to back at
  ``N * offset``, so the parameter is the contiguous view of the first ``numel`` elements
  there and modules compute on views, as FSDP2's unsharded parameters.

One copy converts between them (``unpack`` after an all-gather, ``pack`` before a
reduce-scatter), FSDP2's ``split_with_sizes_copy`` / ``chunk_cat``: that copy is the price of
DTensor's contract (see docs/design.md for its cost). Where the two orders coincide (one
shard, or a bucket of one parameter that fills the shard, e.g. an embedding;
``is_rank_major``) collectives work on the parameter-major tensor directly.

0-d parameters have no dim to chunk. They are *replicated* slots: every rank's region holds
the one element (``Replicate()`` in DTensor terms); ``pack`` sends the element to every
rank, so a reduce-scatter leaves the reduced value on all of them.

Coarse shards (fully-sharded hybrid sharding): a buffer over ``C`` ranks may own ``g = N /
C`` of the ``N`` shards: rank ``k`` owns shards ``k, k + C, ..., k + (g-1)*C`` in that order,
as one contiguous local shard of ``g * shard_numel`` elements. ``pack`` and ``unpack`` take
``coarse=C`` and read the gathered ``(C, g, shard_numel)`` tensor in that order.

Note [whole placement]. Optimizers that need a whole matrix per step (Muon, Shampoo) cannot
step a row piece. A parameter given an ``owner`` is a *whole* slot: shard ``owner`` holds
all of it, the other shards nothing of it. Each shard is then ``[uniform region | the whole
slots it owns, back to back | padding]``: the row-split and replicated slots keep their
common offsets (the uniform region, ending at ``region_end``), and each whole slot's
``offset`` is its place in its owner's shard, after ``region_end``. The parameter-major
buffer keeps the uniform region as above and then every shard's tail (``shard_numel -
region_end`` elements) in shard order: a whole parameter is contiguous there too (in its
owner's tail), so modules compute on views, and the same one collective and one copy
serve both kinds. Owners are balanced by ``assign_owners`` (greedy, largest first; in
``slot_placement``, with ``compute_layout``); the shard size is set by the most loaded
shard, the rest is padding.

This module is the layout's arithmetic plus the two copies (``slot_placement`` lays the
slots out; a ``Bucket`` runs the copy-out itself, into the ``unpack_targets`` it keeps);
no process groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "DEFAULT_ALIGNMENT",
    "FlatLayout",
    "ParamSlot",
    "StagingTargets",
    "UnpackTargets",
]

DEFAULT_ALIGNMENT: int = 16
"""Shard alignment in elements: every shard starts 16-byte aligned even in a 1-byte dtype
(fp8; 32 B of bf16, 64 B of fp32), what vectorized copies and NCCL want."""


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in every rank's shard."""

    index: int  # position in the group
    shape: tuple[int, ...]
    offset: int  # element offset of its region in each rank's shard
    numel: int
    row_numel: int  # prod(shape[1:]); 1 for 0-d and 1-d params
    chunk_rows: int  # rows per rank's region: ceil(rows / N); 1 for a replicated slot
    replicated: bool = False  # 0-d: every rank holds the element
    owner: int | None = None  # whole placement: the one shard holding all of it
    # Derived once (read per parameter per step): whether one shard (``owner``) holds the
    # whole parameter (Note [whole placement]); the elements of its region in each rank's
    # shard (in its owner's, for a whole slot).
    whole: bool = field(init=False, repr=False, compare=False)
    width: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "whole", self.owner is not None)
        object.__setattr__(self, "width", self.chunk_rows * self.row_numel)
        numel = math.prod(self.shape)
        row_numel = math.prod(self.shape[1:])
        if self.numel != numel or self.row_numel != row_numel:
            raise ValueError(
                f"ParamSlot {self.index}: numel={self.numel}, row_numel={self.row_numel} do "
                f"not match shape {self.shape} (expected {numel} and {row_numel})"
            )
        if self.offset < 0 or self.chunk_rows < 0:
            raise ValueError(
                f"ParamSlot {self.index}: offset and chunk_rows must be >= 0, got "
                f"{self.offset} and {self.chunk_rows}"
            )
        if self.replicated != (len(self.shape) == 0):
            raise ValueError(
                f"ParamSlot {self.index}: exactly the 0-d parameters are replicated slots "
                f"(shape {self.shape}, replicated={self.replicated})"
            )
        if self.owner is not None and (
            self.owner < 0 or not self.shape or self.chunk_rows != self.shape[0]
        ):
            raise ValueError(
                f"ParamSlot {self.index}: a whole slot (owner={self.owner}) needs an owner "
                f">= 0, at least one dim and chunk_rows equal to its rows (shape "
                f"{self.shape}, chunk_rows={self.chunk_rows})"
            )

    @property
    def rows(self) -> int:
        """Number of dim-0 rows: ``shape[0]``, or 1 for a 0-d parameter."""
        return self.shape[0] if self.shape else 1


@dataclass(frozen=True)
class FlatLayout:
    """Where a group's parameters live in ``shard_count`` equal shards (Note [shard layout]).

    Constructing one checks every invariant (regions in order, back to back, inside the
    shard; chunk sizes as ``torch.chunk`` makes them; aligned shards), so a
    ``FlatLayout`` is always valid.
    """

    slots: tuple[ParamSlot, ...]
    shard_count: int
    shard_numel: int  # S
    alignment: int
    # Derived once (read per gather and reduction): elements of the gathered (and of the
    # parameter-major) buffer, ``N * S``; the share of them that is padding (0.0 for an
    # empty buffer).
    total_numel: int = field(init=False, repr=False, compare=False)
    padding_fraction: float = field(init=False, repr=False, compare=False)
    _used_numel: int = field(init=False, repr=False, compare=False)
    _region_end: int = field(init=False, repr=False, compare=False)
    _uniform: tuple[ParamSlot, ...] = field(init=False, repr=False, compare=False)
    _rank_end: tuple[int, ...] = field(init=False, repr=False, compare=False)
    # Widths of ``_regions``' entries along their last dim (what ``unpack`` splits into).
    _split_sizes: list[int] = field(init=False, repr=False, compare=False)
    # Views made once per (parameter-major tensor, g, c): bucket tensors live as long as
    # their buffer (a freed bucket keeps its storage object, so views stay valid), and
    # building the views is most of a copy-out's host time on small buckets.
    _views: dict[tuple[int, int, int, str], tuple[torch.Tensor, list[torch.Tensor]]] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        n, s, a = self.shard_count, self.shard_numel, self.alignment
        if n < 1 or a < 1 or s < 0 or s % a:
            raise ValueError(
                f"FlatLayout needs shard_count >= 1, alignment >= 1 and shard_numel a "
                f"non-negative multiple of alignment; got shard_count={n}, "
                f"shard_numel={s}, alignment={a}"
            )
        cursor = 0
        used = 0
        for i, slot in enumerate(self.slots):
            if slot.index != i:
                raise ValueError(f"FlatLayout slot at position {i} has index {slot.index}")
            used += slot.numel
            if slot.whole:
                continue
            if slot.offset != cursor:
                raise ValueError(
                    f"FlatLayout slot {i} starts at {slot.offset}; regions are back to back, "
                    f"so it must start at {cursor}"
                )
            want = 1 if slot.replicated else -(-slot.rows // n)
            if slot.chunk_rows != want:
                raise ValueError(
                    f"FlatLayout slot {i} (shape {slot.shape}) has chunk_rows="
                    f"{slot.chunk_rows}; torch.chunk over {n} ranks gives {want}"
                )
            cursor += slot.width
        # Whole slots: back to back in their owner's shard after the uniform region.
        rank_end = [cursor] * n
        for slot in self.slots:
            if not slot.whole:
                continue
            assert slot.owner is not None
            if slot.owner >= n:
                raise ValueError(
                    f"FlatLayout slot {slot.index} is owned by shard {slot.owner}; there are {n}"
                )
            if slot.offset != rank_end[slot.owner]:
                raise ValueError(
                    f"FlatLayout whole slot {slot.index} starts at {slot.offset} in shard "
                    f"{slot.owner}; it must start at {rank_end[slot.owner]}"
                )
            rank_end[slot.owner] += slot.width
        if max(rank_end) > s:
            raise ValueError(
                f"FlatLayout regions end at {max(rank_end)}, past the shard of {s} elements"
            )
        total = n * s
        object.__setattr__(self, "total_numel", total)
        object.__setattr__(self, "padding_fraction", (total - used) / total if total else 0.0)
        object.__setattr__(self, "_used_numel", used)
        object.__setattr__(self, "_region_end", cursor)
        object.__setattr__(self, "_uniform", tuple(x for x in self.slots if not x.whole))
        object.__setattr__(self, "_rank_end", tuple(rank_end))
        sizes = [x.width for x in self._uniform] + [self.shard_numel - cursor]
        object.__setattr__(self, "_split_sizes", sizes)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_views"] = {}  # copies and pickles do not carry views of the buckets
        return state

    # ---- sizes ------------------------------------------------------------------------
    @property
    def used_numel(self) -> int:
        """Elements that belong to parameters (a replicated slot counts once)."""
        return self._used_numel

    @property
    def padding_numel(self) -> int:
        return self.total_numel - self._used_numel

    # ---- who holds what ---------------------------------------------------------------
    def _check_rank(self, shard_rank: int) -> None:
        if not 0 <= shard_rank < self.shard_count:
            raise ValueError(f"shard_rank must be in [0, {self.shard_count}), got {shard_rank}")

    def _slot(self, index: int) -> ParamSlot:
        if not 0 <= index < len(self.slots):
            raise IndexError(f"param index must be in [0, {len(self.slots)}), got {index}")
        return self.slots[index]

    def shard_bounds(self, shard_rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``shard_rank``'s shard in the gathered (rank-major) buffer."""
        self._check_rank(shard_rank)
        start = shard_rank * self.shard_numel
        return start, start + self.shard_numel

    def local_rows(self, index: int, shard_rank: int) -> tuple[int, int]:
        """``[row_start, row_end)`` of param ``index`` held by ``shard_rank``: its
        ``torch.chunk`` piece (every rank holds the row of a replicated slot)."""
        slot = self._slot(index)
        self._check_rank(shard_rank)
        if slot.replicated:
            return 0, 1
        if slot.whole:
            return (0, slot.rows) if shard_rank == slot.owner else (0, 0)
        c, rows = slot.chunk_rows, slot.rows
        return min(shard_rank * c, rows), min((shard_rank + 1) * c, rows)

    def row_partition(self, index: int) -> tuple[tuple[int, int], ...]:
        """``local_rows(index, k)`` for every rank ``k``, in rank order."""
        return tuple(self.local_rows(index, k) for k in range(self.shard_count))

    @property
    def has_whole(self) -> bool:
        """Whether any slot is whole-placed (Note [whole placement])."""
        return len(self._uniform) != len(self.slots)

    def rank_offset(self, index: int, shard_rank: int) -> int:
        """Offset of param ``index``'s region in ``shard_rank``'s shard."""
        slot = self._slot(index)
        self._check_rank(shard_rank)
        return slot.offset if not slot.whole or slot.owner == shard_rank else self._region_end

    def rank_width(self, index: int, shard_rank: int) -> int:
        """Elements of param ``index``'s region in ``shard_rank``'s shard."""
        slot = self._slot(index)
        self._check_rank(shard_rank)
        return slot.width if not slot.whole or slot.owner == shard_rank else 0

    def rank_used(self, shard_rank: int) -> int:
        """End of the regions in ``shard_rank``'s shard: the rest of it is padding."""
        self._check_rank(shard_rank)
        return self._rank_end[shard_rank]

    def is_rank_major(self, coarse: int | None = None) -> bool:
        """Whether the parameter-major order already is the rank-major one (one shard,
        or one sharded parameter filling the shard, read over all ranks), so that
        collectives may use the parameter-major tensor directly, with no copy."""
        if self.shard_count == 1:
            return True
        if coarse is not None and coarse != self.shard_count:
            return False
        if self.has_whole and self._region_end == 0:
            return True  # only shard tails, which are rank-major (Note [whole placement])
        return (
            len(self.slots) == 1
            and not self.slots[0].replicated
            and self.slots[0].width == self.shard_numel
        )

    def param_offset(self, index: int) -> int:
        """Offset of param ``index`` in the parameter-major buffer."""
        slot = self._slot(index)
        if slot.whole:
            assert slot.owner is not None
            tail = self.shard_numel - self._region_end
            return (
                self.shard_count * self._region_end
                + slot.owner * tail
                + slot.offset
                - self._region_end
            )
        return self.shard_count * slot.offset

    # ---- the two copies (Note [shard layout]) -------------------------------------------
    def _cached(
        self, kind: str, pm: torch.Tensor, g: int, c: int, make: Callable[[], list[torch.Tensor]]
    ) -> list[torch.Tensor]:
        """``make()``, kept per ``pm`` (the same tensor object) and ``(g, c)``; at most a
        few tensors per layout (its weight and gradient buckets)."""
        key = (id(pm), g, c, kind)
        hit = self._views.get(key)
        if hit is not None and hit[0] is pm:
            return hit[1]
        views = make()
        if len(self._views) >= _MAX_CACHED_VIEWS:
            self._views.clear()
        self._views[key] = (pm, views)
        return views

    def _regions(self, pm: torch.Tensor, g: int, c: int) -> list[torch.Tensor]:
        """Each uniform (not whole) parameter's regions of the parameter-major tensor ``pm``
        as ``(g, c, width)`` (shard ``j*c + k`` at ``[j, k]``), plus the shard tails (whole
        slots and padding) as a last entry."""
        return self._cached("regions", pm, g, c, lambda: self._make_regions(pm, g, c))

    def _make_regions(self, pm: torch.Tensor, g: int, c: int) -> list[torch.Tensor]:
        n = self.shard_count
        out = []
        for slot in self._uniform:
            start = n * slot.offset
            out.append(pm[start : start + n * slot.width].view(g, c, slot.width))
        start = n * self._region_end
        out.append(pm[start : self.total_numel].view(g, c, self.shard_numel - self._region_end))
        return out

    def _coarse(self, coarse: int | None) -> tuple[int, int]:
        c = self.shard_count if coarse is None else coarse
        if c < 1 or self.shard_count % c:
            raise ValueError(f"coarse={c} must divide shard_count={self.shard_count}")
        return self.shard_count // c, c

    def unpack(self, gathered: torch.Tensor, pm: torch.Tensor, coarse: int | None = None) -> None:
        """Copy an all-gather's output (rank-major, over ``coarse`` ranks) into the
        parameter-major tensor ``pm`` (``UnpackTargets.copy``; a bucket keeps its
        targets, ``Bucket._copy_out``)."""
        self.unpack_targets(pm, coarse).copy(gathered)

    def unpack_targets(self, pm: torch.Tensor, coarse: int | None = None) -> UnpackTargets:
        """Where ``unpack`` puts an all-gather's output in ``pm``, with its views made
        now, for a caller that keeps them (a bucket, per gather). Valid while ``pm`` is
        the same tensor object."""
        g, c = self._coarse(coarse)
        return UnpackTargets((c, g, self.shard_numel), self._split_sizes, self._regions(pm, g, c))

    def pack(self, pm: torch.Tensor, out: torch.Tensor, coarse: int | None = None) -> None:
        """Copy the parameter-major ``pm`` into ``out``, rank-major over ``coarse`` ranks
        (what a reduce-scatter takes); padding is sent as zeros, and a replicated slot's
        element to every rank."""
        g, c = self._coarse(coarse)
        parts = self._cached("pack", pm, g, c, lambda: self._pack_parts(pm, g, c))
        dst = out.view(c, g, self.shard_numel).transpose(0, 1)
        if g == 1 and out.dtype == pm.dtype:
            torch.cat(parts, dim=2, out=dst)
        else:
            dst.copy_(torch.cat(parts, dim=2))
        if self.has_whole:  # the tails were sent as they are: zero their padding
            for shard, end in enumerate(self._rank_end):
                dst[shard // c, shard % c, end:].zero_()

    def _pack_parts(self, pm: torch.Tensor, g: int, c: int) -> list[torch.Tensor]:
        parts = list(self._regions(pm, g, c))
        for i, slot in enumerate(self._uniform):
            if slot.replicated:
                parts[i] = parts[i][:1, :1].expand(g, c, 1)
        if not self.has_whole:  # else the tails hold whole slots: sent as they are
            parts[-1] = pm.new_zeros(()).expand(g, c, parts[-1].shape[-1])
        return parts

    def rank_regions(self, pm: torch.Tensor, shard_rank: int) -> list[torch.Tensor]:
        """Views of ``shard_rank``'s region of each parameter inside the parameter-major
        ``pm`` (a replicated slot's: its element; a whole slot's: all of it on its owner,
        nothing elsewhere)."""
        self._check_rank(shard_rank)
        # Not cached: ``pm`` may be a temporary here.
        regions = self._make_regions(pm, 1, self.shard_count)
        uniform = iter(self._uniform_pieces(regions, shard_rank))
        out = []
        for slot in self.slots:
            if slot.whole:
                start = self.param_offset(slot.index) if slot.owner == shard_rank else 0
                out.append(pm[start : start + self.rank_width(slot.index, shard_rank)])
            else:
                out.append(next(uniform))
        return out

    def _uniform_pieces(self, regions: list[torch.Tensor], shard_rank: int) -> list[torch.Tensor]:
        """``shard_rank``'s piece of each uniform slot, from ``_make_regions``' views over
        one coarse group (a replicated slot's: its element)."""
        return [
            r[0, 0, :1] if slot.replicated else r[0, shard_rank]
            for slot, r in zip(self._uniform, regions[:-1], strict=True)
        ]

    def pack_rank(
        self, pm: torch.Tensor, shard_rank: int, out: torch.Tensor, keep_views: bool = False
    ) -> None:
        """Copy ``shard_rank``'s shard out of the parameter-major ``pm`` into ``out``.
        ``keep_views``: ``pm`` is a buffer's own tensor, not a temporary, so its views are
        made once."""
        self._check_rank(shard_rank)
        if not self.has_whole and out.dtype == pm.dtype:
            # The shard is the uniform slots' pieces back to back, then padding: one copy.
            n = self.shard_count
            if keep_views:
                pieces = self._cached(
                    f"rank{shard_rank}",
                    pm,
                    1,
                    n,
                    lambda: self._uniform_pieces(self._regions(pm, 1, n), shard_rank),
                )
            else:
                pieces = self._uniform_pieces(self._make_regions(pm, 1, n), shard_rank)
            end = self._region_end
            if pieces:  # torch.cat takes no empty list
                torch.cat(pieces, out=out[:end])
            out[end:].zero_()
            return
        regions = self.rank_regions(pm, shard_rank)
        for slot, region in zip(self.slots, regions, strict=True):
            start = self.rank_offset(slot.index, shard_rank)
            out[start : start + region.numel()].copy_(region)
        out[self._rank_end[shard_rank] :].zero_()

    def unpack_rank(self, shard: torch.Tensor, shard_rank: int, pm: torch.Tensor) -> None:
        """Copy ``shard`` (``shard_rank``'s) into its regions of the parameter-major ``pm``."""
        regions = self.rank_regions(pm, shard_rank)
        for slot, region in zip(self.slots, regions, strict=True):
            start = self.rank_offset(slot.index, shard_rank)
            region.copy_(shard[start : start + region.numel()])

    # ---- gradients written rank-major (Note [gradient staging] in bucket_grads) ----------
    def staging_targets(self, rm: torch.Tensor, coarse: int | None = None) -> StagingTargets:
        """Where each parameter's gradient goes in ``rm``, a tensor laid out as ``pack``'s
        output (rank-major over ``coarse`` ranks), and what a reduction must zero there:
        the pieces no parameter covers (region and shard padding)."""
        g, c = self._coarse(coarse)
        s = self.shard_numel
        grid = rm.view(c, g, s).transpose(0, 1)  # [j, k]: shard j*c + k
        writes: list[tuple[tuple[torch.Tensor, int | None, int, tuple[int, ...]], ...]] = []
        regions: list[torch.Tensor] = []
        padding: list[torch.Tensor] = []
        for slot in self.slots:
            if slot.whole:
                assert slot.owner is not None
                j, k = divmod(slot.owner, c)
                dst = grid[j, k, slot.offset : slot.offset + slot.numel].view(slot.shape)
                writes.append(((dst, None, 0, slot.shape),))
                regions.append(dst)
                continue
            region = grid[:, :, slot.offset : slot.offset + slot.width]
            regions.append(region)
            if slot.width == 0:
                writes.append(())
            elif slot.replicated:  # the element to every shard, as ``pack`` sends it
                writes.append(((region, None, 0, ()),))
            elif slot.numel == self.shard_count * slot.width:  # every shard holds c rows
                writes.append(((region, None, 0, (g, c, slot.width)),))
            else:  # ragged torch.chunk pieces: one copy per shard, padding zeroed
                pieces = []
                for shard in range(self.shard_count):
                    r0, r1 = self.local_rows(slot.index, shard)
                    n = (r1 - r0) * slot.row_numel
                    j, k = divmod(shard, c)
                    if n:
                        pieces.append((region[j, k, :n], r0, r1, (n,)))
                    if n < slot.width:
                        padding.append(region[j, k, n:])
                writes.append(tuple(pieces))
        if self.has_whole:
            for shard, end in enumerate(self._rank_end):
                if end < s:
                    j, k = divmod(shard, c)
                    padding.append(grid[j, k, end:])
        elif self._region_end < s:
            padding.append(grid[:, :, self._region_end :])
        return StagingTargets(tuple(writes), tuple(regions), tuple(padding))


@dataclass(frozen=True)
class UnpackTargets:
    """Views of a parameter-major tensor for the copy-out of an all-gather's output
    (``unpack_targets``): the rank-major output viewed as ``gathered_shape`` ``(c, g,
    shard_numel)`` and transposed to ``(g, c, shard_numel)`` splits along its last dim
    by ``split_sizes`` into ``regions``, each uniform parameter's ``(g, c, width)``
    regions and then the shard tails."""

    gathered_shape: tuple[int, int, int]
    split_sizes: list[int]
    regions: list[torch.Tensor]

    def copy(self, gathered: torch.Tensor) -> None:
        """The copy-out of ``gathered`` into ``regions`` (one ``split_with_sizes_copy``)."""
        c, g, _ = self.gathered_shape
        src = gathered.view(self.gathered_shape).transpose(0, 1)
        if g > 1 and c > 1:
            # Transposed, the source is dense but not row-major, and CUDA's
            # split_with_sizes_copy reads any dense source as row-major: one copy per
            # region instead (its own general path), no third copy of the bucket.
            for region, part in zip(self.regions, src.split(self.split_sizes, 2), strict=True):
                region.copy_(part)
            return
        torch.split_with_sizes_copy(src, self.split_sizes, 2, out=self.regions)


@dataclass(frozen=True)
class StagingTargets:
    """Views of a rank-major reduce-scatter input, made per tensor (``staging_targets``).

    ``writes[i]``: ``(dst, r0, r1, shape)`` pieces taking parameter ``i``'s gradient
    ``grad[r0:r1].reshape(shape)`` (all of ``grad`` when ``r0`` is None); ``regions[i]``:
    everything parameter ``i`` covers; ``padding``: what no parameter covers."""

    writes: tuple[tuple[tuple[torch.Tensor, int | None, int, tuple[int, ...]], ...], ...]
    regions: tuple[torch.Tensor, ...]
    padding: tuple[torch.Tensor, ...]

    def write(self, index: int, grad: torch.Tensor, first: bool) -> None:
        """Copy (``first``) or add parameter ``index``'s gradient into its pieces."""
        for dst, r0, r1, shape in self.writes[index]:
            src = grad.reshape(shape) if r0 is None else grad[r0:r1].reshape(shape)
            if first:
                dst.copy_(src)
            else:
                dst.add_(src)

    def zero_rest(self, touched: Sequence[bool]) -> None:
        """Zero the regions of the parameters not written since the tensor was fetched,
        and the padding, so the tensor is what ``pack`` of a zeroed bucket plus those
        gradients would give."""
        for region, written in zip(self.regions, touched, strict=True):
            if not written:
                region.zero_()
        for pad in self.padding:
            pad.zero_()


_MAX_CACHED_VIEWS = 8
