"""Check a state dict against a checkpoint's metadata before reading anything, so that
missing keys, unexpected keys and shape mismatches are reported together, by name,
on every rank (DCP alone stops at the first one, or hangs when ranks disagree).

Ranks may hold different keys (expert parallelism): a checkpoint entry is unexpected
only when no rank has it, so ``Mismatch.combine`` merges every rank's findings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["Mismatch", "find_mismatches", "flatten", "mismatches"]

_SHOWN = 20


def flatten(tree: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """Nested mappings as DCP names their leaves: ``prefix.key.subkey`` (``key.subkey``
    for an empty prefix)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


def _show(keys: list[str]) -> str:
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return ", ".join(keys[:_SHOWN]) + more


@dataclass(frozen=True)
class Mismatch:
    """What one rank found: keys missing from the checkpoint, checkpoint entries it
    does not have, and entries of another shape or kind."""

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    wrong: tuple[str, ...] = ()

    @classmethod
    def combine(cls, found: Sequence[Mismatch]) -> Mismatch:
        """Every rank's findings as one: missing or wrong on any rank, unexpected on
        every rank (another rank may hold the entry)."""
        if not found:
            return cls()
        unexpected = set(found[0].unexpected).intersection(*(f.unexpected for f in found[1:]))
        return cls(
            tuple(sorted({k for f in found for k in f.missing})),
            tuple(sorted(unexpected)),
            tuple(sorted({k for f in found for k in f.wrong})),
        )

    def describe(self) -> str | None:
        parts = []
        if self.missing:
            parts.append(f"missing from the checkpoint: {_show(list(self.missing))}")
        if self.unexpected:
            parts.append(f"in the checkpoint but not here: {_show(list(self.unexpected))}")
        if self.wrong:
            parts.append(f"shape mismatch: {_show(list(self.wrong))}")
        return "; ".join(parts) if parts else None


def find_mismatches(
    ours: Mapping[str, Any], saved: Mapping[str, Any], *, strict: bool = True
) -> Mismatch:
    """What is wrong between ``ours`` (flat DCP keys) and ``saved`` (the checkpoint's
    metadata entries of the same part, e.g. the model's), seen from this rank.
    ``strict=False`` tolerates checkpoint entries that ``ours`` does not have."""
    missing = sorted(k for k in ours if k not in saved)
    unexpected = sorted(k for k in saved if k not in ours) if strict else []
    wrong: list[str] = []
    for key in sorted(set(ours) & set(saved)):
        value, md = ours[key], saved[key]
        if isinstance(value, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                wrong.append(f"{key} (saved as a non-tensor, here a tensor)")
            elif tuple(md.size) != tuple(value.shape):
                wrong.append(f"{key} (checkpoint {tuple(md.size)}, here {tuple(value.shape)})")
    return Mismatch(tuple(missing), tuple(unexpected), tuple(wrong))


def mismatches(
    ours: Mapping[str, Any], saved: Mapping[str, Any], *, strict: bool = True
) -> str | None:
    """``find_mismatches`` described; None when they match."""
    return find_mismatches(ours, saved, strict=strict).describe()
