"""The exceptions this package raises. All are ``RuntimeError``s (so ``Exception``s:
torch's own ``CheckpointException`` from DCP is a ``BaseException`` that ``except
Exception:`` misses, and is raised here as the ``__cause__`` of a ``CheckpointError``);
the subclasses say which way a checkpoint is wrong."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "ForeignCheckpointWarning",
    "IncompleteCheckpointError",
    "dcp_failure",
]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint at the path (also a ``FileNotFoundError``, which code written
    before this class existed catches)."""


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


def dcp_failure(exc: BaseException, what: str) -> CheckpointError:
    """DCP's ``CheckpointException`` (a ``BaseException``, which ``except Exception``
    misses) as a ``CheckpointError``: ``what`` then each failed rank's exception (DCP
    raises it on every rank, so this is the same on every rank). Raise it ``from exc``."""
    failures = getattr(exc, "failures", None) or {}
    shown = "; ".join(
        f"rank {r}: {type(e).__name__}: {e}"
        for r, pair in sorted(failures.items())
        for e in [pair[0] if isinstance(pair, tuple) else pair]
    )
    return CheckpointError(f"{what}: {shown or exc}")
