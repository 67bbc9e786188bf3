"""Per-file CRC-32 checksums of a checkpoint: computed at save, verified at load.

Sizes alone miss a file overwritten in place (a flipped float loads silently), and a
damaged ``.metadata`` or ``extra`` pickle would otherwise surface as whatever
unpickling raises. Each rank checksums the files it wrote (DCP's ``__<rank>_<i>.distcp``
and ``extra/rank_<rank>.pt``; rank 0 the rest), so saving and verifying cost one read
of every byte, spread over the ranks like the writes: zlib's CRC-32 runs at about
1 GB/s per core, and the files were just written (or are about to be read) so they are
usually in the page cache. CRC-32 detects accidental damage (every burst of up to 32
bits, and all but 2^-32 of other changes); it is not a defence against tampering.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable
from pathlib import Path

__all__ = ["checksum_owner", "crc32_of", "crc32_of_files"]

_CHUNK = 16 << 20
_RANK_FILE = re.compile(r"(?:^|/)(?:__(\d+)_\d+\.distcp|rank_(\d+)\.pt)$")


def crc32_of(path: Path) -> int:
    """CRC-32 of the file's bytes, read once in 16 MiB chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def checksum_owner(rel: str, world_size: int) -> int:
    """The rank that checksums ``rel``: the rank that wrote it when the name says
    (modulo the world size, for a load at another size), else rank 0."""
    match = _RANK_FILE.search(rel)
    if match is None:
        return 0
    return int(match.group(1) or match.group(2)) % world_size


def crc32_of_files(directory: Path, rels: Iterable[str], rank: int, world_size: int) -> dict:
    """``{rel: crc32}`` of the files among ``rels`` that ``rank`` owns."""
    return {
        rel: crc32_of(directory / rel) for rel in rels if checksum_owner(rel, world_size) == rank
    }
