"""When a bucket that coalesced FSDP units share may be released.

Unit coalescing (``suggested_communication_unit_size``; Note [communication units] in
``fsdp_buffers.param_group``) joins consecutive units into one communication unit whose
buckets they share. The first unit's pre-forward gathers the shared buckets (and
prefetches what follows them); the others find them gathered. A shared bucket is
released after every unit sharing it has run its forward (a unit the forward skipped
leaves it gathered until the root post-forward, which releases it), and, in backward,
after the post-backward of the last of them whose backward was pending. It is one
tensor, so memory is freed per communication unit, not per unit. Its reduction starts
at that same point, so the units' gradients reduce as one. Another graph's end of
backward (``l1 = f(x1); l2 = f(x2); l1.backward(); l2.backward()``, an auxiliary loss
backpropagated on its own first) and a forward that no backward follows (a ``no_grad``
forward in between) reset the counts (``FSDPUnit.pending_backward``) to zero, and zero
counts would release the bucket at the first sharer's post-backward, before the others'
backward. So each root forward records its unit calls and hands them to its output's
root pre-backward, which sets the counts of the backward that begins to them (adds them,
for a second graph of the same backward), plus the unit calls made outside any root
forward since the last end of backward. Counts too high (a graph that a backward
reaches only partly) only defer the release and reduction to the end of backward. No
count loses a gradient: what a reduction did not see is reduced at the end of backward
(``GradReducePipeline.finish``).

A bucket used by one unit only is not tracked here: it is released at that unit's
post-forward and post-backward, as without coalescing.
"""

from __future__ import annotations

import warnings
from operator import attrgetter

from fsdp_buffers import ParamAndGradBuffer
from fsdp_hooks.runtime.unit import FSDPUnit

# A communication unit holding more than this share of the units' parameters is reported
# at wrap: its units are gathered and held together, which ZeRO-3 is meant to avoid.
_WIDE_GROUP_SHARE = 0.5

__all__ = ["SharedBuckets", "backward_done", "warn_if_units_joined_widely"]


_pending_backward = attrgetter("pending_backward")


def backward_done(units: list[FSDPUnit]) -> bool:
    """Whether none of ``units`` has a forward call whose backward is still to come: the
    rule for releasing (and reducing) a shared bucket after backward."""
    return not any(map(_pending_backward, units))  # C-level: no generator frame per unit


class SharedBuckets:
    """The units sharing each coalesced bucket, and which of them ran forward since the
    bucket was gathered."""

    def __init__(self, buffer: ParamAndGradBuffer, units: list[FSDPUnit]) -> None:
        sharers: dict[int, list[FSDPUnit]] = {}
        for unit in units:
            for gid in unit.release_groups:
                if unit.index in buffer.groups[gid].coalesced_unit_ids:
                    sharers.setdefault(gid, []).append(unit)
        self.sharers = {g: us for g, us in sharers.items() if len(us) > 1}
        self._forward_done: dict[int, set[int]] = {}

    def release_after_forward(self, unit: FSDPUnit, gid: int) -> bool:
        """``unit`` finished a forward: whether bucket ``gid`` can be released now."""
        sharers = self.sharers.get(gid)
        if sharers is None:
            return True
        done = self._forward_done.setdefault(gid, set())
        done.add(unit.index)
        if len(done) < len(sharers):
            return False  # a unit sharing it has yet to run forward
        del self._forward_done[gid]
        return True

    def release_after_backward(self, gid: int) -> bool:
        """A unit using ``gid`` finished a backward: whether it can be released now."""
        sharers = self.sharers.get(gid)
        return sharers is None or backward_done(sharers)

    def take_partly_run(self) -> list[int]:
        """End of a forward: the shared buckets some of whose units it skipped (still
        gathered), forgotten here; the caller releases them."""
        out = list(self._forward_done)
        self._forward_done.clear()
        return out

    def clear(self) -> None:
        self._forward_done.clear()


def warn_if_units_joined_widely(buffer: ParamAndGradBuffer, size: int) -> None:
    """Warn (the same on every rank) when ``suggested_communication_unit_size=size``
    joined several units into a communication unit holding more than half of the
    parameters in units: under ZeRO-3 they are gathered and held together. Megatron-FSDP
    sizes its prefetch with the same option, so a value tuned for it (hundreds of
    millions) makes one group of the whole model here."""
    per_unit: dict[int, int] = {}
    members: dict[int, int] = {}
    for group in buffer.groups:
        if group.fsdp_unit_id is None:
            continue
        n = sum(p.numel() for p in group.params)
        per_unit[group.fsdp_unit_id] = per_unit.get(group.fsdp_unit_id, 0) + n
        members[group.fsdp_unit_id] = len(group.coalesced_unit_ids)
    total = sum(per_unit.values())
    wide = {u: n for u, n in per_unit.items() if members[u] > 1 and n > _WIDE_GROUP_SHARE * total}
    if not wide:
        return
    unit, numel = next(iter(wide.items()))
    warnings.warn(
        f"fsdp: suggested_communication_unit_size={size} joins {members[unit]} FSDP units "
        f"into one communication unit of {numel:,} of the units' {total:,} parameter "
        "elements: they are gathered, held and reduced together, so under ZeRO-3 the "
        "gathered peak is that group's, not one unit's. fsdp uses this option to coalesce "
        "small units (Megatron-FSDP uses it to size its prefetch); pass 0 for one "
        "collective per unit, or None for the default (under ZeRO-3, pairs of units under "
        "65,536 elements)",
        UserWarning,
        stacklevel=4,
    )
