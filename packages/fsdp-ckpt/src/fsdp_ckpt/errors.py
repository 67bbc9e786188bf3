"""The exceptions this package raises. All are ``RuntimeError``s, so code that caught
DCP's own errors keeps working; the subclasses say which way a checkpoint is wrong."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "ForeignCheckpointWarning",
    "IncompleteCheckpointError",
]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded."""


class IncompleteCheckpointError(CheckpointError):
    """The directory has no manifest: a save was interrupted, or it is not an fsdp
    checkpoint."""


class CorruptCheckpointError(CheckpointError):
    """A file of the checkpoint is missing, has the wrong size or checksum, or cannot
    be read (a damaged manifest, ``.metadata`` or extra-state file)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint's keys or shapes do not match the state being loaded."""


class ForeignCheckpointWarning(UserWarning):
    """A plain DCP checkpoint (no fsdp manifest) is being loaded: its file sizes cannot
    be verified against a manifest, and it holds no extra state or RNG states."""
