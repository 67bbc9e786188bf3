"""Where a checkpoint is written while it is incomplete, and how it is put in place.

A save writes into the hidden sibling ``.<name>.incomplete``; once every rank has
finished, rank 0 writes the manifest into it and moves it into place: an existing
checkpoint at the path is first renamed to ``.<name>.old``, the new one renamed in,
and the old one deleted. Renames within one directory are atomic, so at every instant
either the new or the previous complete checkpoint is at the path, or, between the two
renames, the previous one is at ``.<name>.old``, where ``resolve_for_load`` finds it.
A process killed at any point leaves the previous checkpoint loadable; the next save
clears the leftovers.

A save only ever replaces an fsdp checkpoint or an empty directory: anything else at
the path (a file, a directory holding other files, a checkpoint to which files were
added) is refused before anything is written (``check_replaceable``), so a mistyped
path never deletes a user's files.
"""

from __future__ import annotations

import itertools
import logging
import shutil
from pathlib import Path

from fsdp_ckpt.errors import CheckpointError, CheckpointNotFoundError
from fsdp_ckpt.manifest import MANIFEST_NAME, Manifest, fsync_dir

__all__ = ["check_replaceable", "incomplete_dir", "old_dir", "publish", "resolve_for_load"]

_SHOWN = 5

logger = logging.getLogger("fsdp_ckpt")


def incomplete_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.incomplete"


def old_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.old"


def check_replaceable(path: Path) -> None:
    """Raise ``CheckpointError`` unless a save may replace what is at ``path``: nothing,
    an empty directory, or an fsdp checkpoint holding only the files its manifest
    lists. Reads only the manifest; lists the tree only up to its first file unless
    it is a checkpoint."""
    if not path.exists() and not path.is_symlink():
        return
    refuse = f"refusing to save a checkpoint to {path}"
    if path.is_symlink() or not path.is_dir():
        raise CheckpointError(
            f"{refuse}: it exists and is not a directory; a save replaces its path with "
            "a checkpoint directory, so give a path that does not exist, an empty "
            "directory, or an earlier fsdp checkpoint"
        )
    if not (path / MANIFEST_NAME).is_file():
        # Stop at the first file: the path may be a large tree (a home directory).
        if next((p for p in path.rglob("*") if not p.is_dir()), None) is None:
            return  # an empty directory (or empty subdirectories only)
        shown = sorted(p.name for p in itertools.islice(path.iterdir(), 100))[:_SHOWN]
        raise CheckpointError(
            f"{refuse}: it is a directory that is not an fsdp checkpoint (no "
            f"{MANIFEST_NAME}) and it is not empty (it holds {shown}...); a save replaces "
            "the whole directory, so save to a new or empty directory (e.g. a "
            "subdirectory such as checkpoints/step_100)"
        )
    try:
        manifest = Manifest.read(path)
    except CheckpointError as exc:
        raise CheckpointError(
            f"{refuse}: its {MANIFEST_NAME} cannot be read ({exc}), so it cannot be told "
            "from a directory of other files; remove it yourself or save elsewhere"
        ) from exc
    found = [p.relative_to(path).as_posix() for p in path.rglob("*") if not p.is_dir()]
    others = sorted(f for f in found if f != MANIFEST_NAME and f not in manifest.files)
    if others:
        raise CheckpointError(
            f"{refuse}: it is an fsdp checkpoint but also holds {len(others)} file(s) its "
            f"manifest does not list ({others[:_SHOWN]}), which replacing it would "
            "delete; move them out or save elsewhere"
        )


def publish(staging: Path, path: Path) -> None:
    """Rank 0 only: move the complete ``staging`` directory to ``path``."""
    old = old_dir(path)
    if path.exists():
        if old.exists():
            # Both exist only after a crash following the second rename, and then
            # ``path`` is the newer complete checkpoint.
            shutil.rmtree(old)
        path.rename(old)
    staging.rename(path)
    fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old)


def resolve_for_load(path: Path) -> Path:
    """The directory to load for ``path``: ``path`` itself, or the previous complete
    checkpoint a save interrupted between its two renames left at ``.<name>.old``."""
    if path.exists():
        return path
    old = old_dir(path)
    if (old / MANIFEST_NAME).is_file():
        logger.warning(
            "%s does not exist but %s holds a complete checkpoint (a save was interrupted "
            "while replacing it); loading that",
            path,
            old,
        )
        return old
    hint = ""
    if incomplete_dir(path).exists():
        hint = f" ({incomplete_dir(path)} is an interrupted first save and cannot be loaded)"
    raise CheckpointNotFoundError(f"no checkpoint at {path}{hint}")
