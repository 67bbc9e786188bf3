"""Plain DCP checkpoints: written by ``dcp.save`` (an FSDP2 user's own code), not by
``save_checkpoint``, so they have no manifest.

Such a directory is told apart from an interrupted ``save_checkpoint`` by what each
leaves: DCP writes ``.metadata`` last, after every rank's data, so its presence means
DCP's save completed; ``save_checkpoint`` writes ``extra/`` before any tensor and
stages in ``.<name>.incomplete``, so a directory with either but no manifest is ours,
interrupted or damaged, and stays refused. Without a manifest the file sizes recorded
at save time are unknown; what can be checked is that every file reaches the end of
the last byte range ``.metadata`` places in it, which catches a truncated file.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader

from fsdp_ckpt.errors import CorruptCheckpointError
from fsdp_ckpt.extra import EXTRA_DIR
from fsdp_ckpt.manifest import MANIFEST_NAME

__all__ = ["DCP_METADATA", "is_foreign_dcp", "verify_extents"]

DCP_METADATA = ".metadata"


def is_foreign_dcp(directory: Path) -> bool:
    """A complete DCP checkpoint that ``save_checkpoint`` did not write."""
    return (
        not (directory / MANIFEST_NAME).exists()
        and (directory / DCP_METADATA).is_file()
        and not (directory / EXTRA_DIR).exists()
        and not directory.name.endswith(".incomplete")
    )


def verify_extents(directory: Path) -> None:
    """Refuse a file that is missing or ends before a byte range DCP recorded in it."""
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except Exception as exc:  # a damaged pickle raises anything
        raise CorruptCheckpointError(
            f"cannot read DCP's {DCP_METADATA} in {directory}: {exc!r}"
        ) from exc
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if isinstance(rel, str):
            ends[rel] = max(ends.get(rel, 0), int(info.offset) + int(info.length))
    problems = []
    for rel, end in sorted(ends.items()):
        try:
            size = (directory / rel).stat().st_size
        except OSError:
            problems.append(f"{rel}: missing (DCP's {DCP_METADATA} places {end} bytes in it)")
            continue
        if size < end:
            problems.append(f"{rel}: {size} bytes, DCP's {DCP_METADATA} needs {end} (truncated)")
    if problems:
        raise CorruptCheckpointError(
            f"DCP checkpoint {directory} is damaged; refusing to load it: " + "; ".join(problems)
        )
