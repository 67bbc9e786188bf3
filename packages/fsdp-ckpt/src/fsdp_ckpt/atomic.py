"""Where a checkpoint is written while it is incomplete, and how it is put in place.

A save writes into the hidden sibling ``.<name>.incomplete``; once every rank has
finished, rank 0 writes the manifest into it and moves it into place: an existing
checkpoint at the path is first renamed to ``.<name>.old``, the new one renamed in,
and the old one deleted. Renames within one directory are atomic, so at every instant
either the new or the previous complete checkpoint is at the path, or, between the two
renames, the previous one is at ``.<name>.old``, where ``resolve_for_load`` finds it.
A process killed at any point leaves the previous checkpoint loadable; the next save
clears the leftovers.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from fsdp_ckpt.manifest import MANIFEST_NAME, fsync_dir

__all__ = ["incomplete_dir", "old_dir", "publish", "resolve_for_load"]

logger = logging.getLogger("fsdp_ckpt")


def incomplete_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.incomplete"


def old_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.old"


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
    raise FileNotFoundError(f"no checkpoint at {path}{hint}")
