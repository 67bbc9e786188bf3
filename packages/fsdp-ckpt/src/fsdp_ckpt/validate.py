"""Check a state dict against a checkpoint's metadata before reading anything, so that
missing keys, unexpected keys and shape mismatches are reported together, by name,
on every rank (DCP alone stops at the first one, or hangs when ranks disagree)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["flatten", "mismatches"]

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


def mismatches(
    ours: Mapping[str, Any], saved: Mapping[str, Any], *, strict: bool = True
) -> str | None:
    """What is wrong between ``ours`` (flat DCP keys) and ``saved`` (the checkpoint's
    metadata entries of the same part, e.g. the model's); None when they match.
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
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {_show(missing)}")
    if unexpected:
        parts.append(f"in the checkpoint but not here: {_show(unexpected)}")
    if wrong:
        parts.append(f"shape mismatch: {_show(wrong)}")
    return "; ".join(parts) if parts else None
