"""The manifest: written last, it marks a checkpoint directory complete.

``fsdp_manifest.json`` lists every file of the checkpoint with its size and CRC-32
(see ``checksums``), the world size and the format version. A directory without it is
an interrupted save (or not an fsdp checkpoint) and is refused; a listed file that is
missing, has another size or another checksum is refused too, so a truncated or
overwritten shard is never loaded. Version 1 manifests (sizes only) still load, their
files checked by size.

The names it lists are confined to the directory: one that is absolute or leaves it
(``..``, or a symlink resolving outside) makes the manifest damaged, refused when it is
read, before any listed file is opened; and only regular files are read (``/dev/zero``
or a FIFO would make the reader wait forever).
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_ckpt.errors import CorruptCheckpointError, IncompleteCheckpointError

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MANIFEST_NAME", "Manifest", "fsync_dir"]

MANIFEST_NAME = "fsdp_manifest.json"
FORMAT_NAME = "fsdp-ckpt"
FORMAT_VERSION = 2  # 2: per-file CRC-32 checksums


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (best effort where directories
    cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _inside(directory: Path, rel: str) -> bool:
    """Whether ``rel`` names a path inside ``directory`` once symlinks are resolved
    (absolute names and ``..`` leave it). Resolves without opening anything."""
    if not rel or os.path.isabs(rel) or "\x00" in rel:
        return False
    root = directory.resolve()
    try:
        (root / rel).resolve().relative_to(root)
    except (ValueError, OSError, RuntimeError):  # outside; a symlink loop
        return False
    return True


@dataclass(frozen=True)
class Manifest:
    world_size: int
    files: dict[str, int]  # path relative to the checkpoint directory -> bytes
    has_optimizer: bool
    checksums: dict[str, int] = field(default_factory=dict)  # -> CRC-32; {} in version 1
    format_version: int = FORMAT_VERSION
    created: float = 0.0
    torch_version: str = ""

    @staticmethod
    def list_files(directory: Path) -> list[str]:
        """Every file of a checkpoint directory but the manifest, relative, sorted."""
        return [
            path.relative_to(directory).as_posix()
            for path in sorted(directory.rglob("*"))
            if path.is_file() and path.name != MANIFEST_NAME
        ]

    @classmethod
    def of_directory(
        cls,
        directory: Path,
        *,
        world_size: int,
        has_optimizer: bool,
        checksums: dict[str, int],
    ) -> Manifest:
        """The manifest of ``directory``'s files, with ``checksums`` of every one."""
        import torch

        files = {rel: (directory / rel).stat().st_size for rel in cls.list_files(directory)}
        if set(checksums) != set(files):
            raise CorruptCheckpointError(
                f"files of {directory} changed while it was saved: checksummed "
                f"{sorted(checksums)}, found {sorted(files)}"
            )
        return cls(
            world_size=world_size,
            files=files,
            checksums=dict(sorted(checksums.items())),
            has_optimizer=has_optimizer,
            created=time.time(),
            torch_version=torch.__version__,
        )

    def write(self, directory: Path) -> None:
        """Write durably: to a temporary name, fsync, rename."""
        payload: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "world_size": self.world_size,
            "has_optimizer": self.has_optimizer,
            "created": self.created,
            "torch_version": self.torch_version,
            "files": self.files,
            "crc32": self.checksums,
        }
        tmp = directory / f"{MANIFEST_NAME}.tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / MANIFEST_NAME)
        fsync_dir(directory)

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST_NAME
        if not path.is_file():
            if (directory / "config.json").is_file() and any(
                (directory / n).is_file()
                for n in ("model.safetensors", "model.safetensors.index.json")
            ):
                raise IncompleteCheckpointError(
                    f"{directory} is a Hugging Face save_pretrained directory, not an fsdp "
                    f"checkpoint: load it with fsdp.from_pretrained(model_class, "
                    f"{str(directory)!r}, **fully_shard_model options)"
                )
            raise IncompleteCheckpointError(
                f"{directory} has no {MANIFEST_NAME}: it is an interrupted save or not an "
                f"fsdp checkpoint (complete checkpoints get their manifest last); load an "
                f"earlier checkpoint"
            )
        try:
            payload = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise CorruptCheckpointError(f"cannot read {path}: {exc}") from exc
        if not isinstance(payload, dict) or payload.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(
                f"{path} is not an {FORMAT_NAME} manifest (it holds {str(payload)[:80]!r})"
            )
        version = payload.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise CorruptCheckpointError(
                f"{directory} has format version {version!r}; this fsdp-ckpt reads versions "
                f"up to {FORMAT_VERSION}: upgrade fsdp-ckpt"
            )
        try:
            manifest = cls(
                world_size=int(payload["world_size"]),
                files={str(k): int(v) for k, v in payload["files"].items()},
                checksums={str(k): int(v) for k, v in payload.get("crc32", {}).items()},
                has_optimizer=bool(payload.get("has_optimizer", False)),
                format_version=version,
                created=float(payload.get("created", 0.0)),
                torch_version=str(payload.get("torch_version", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptCheckpointError(f"{path} is damaged: {exc!r}") from exc
        outside = [
            rel for rel in {**manifest.files, **manifest.checksums} if not _inside(directory, rel)
        ]
        if outside:
            raise CorruptCheckpointError(
                f"{path} is damaged: it lists files outside the checkpoint directory "
                f"{directory} ({sorted(outside)[:5]}); a checkpoint's files are relative "
                "names inside it, so none of them was opened"
            )
        unsized = sorted(set(manifest.checksums) - set(manifest.files))
        if unsized:  # each file is checked by size (and kind) before it is read
            raise CorruptCheckpointError(
                f"{path} is damaged: it has checksums of files it does not list: {unsized[:5]}"
            )
        return manifest

    def problems(self, directory: Path) -> list[str]:
        """Every listed file that is missing or has a size other than the listed one."""
        out = []
        for rel, size in self.files.items():
            path = directory / rel
            try:
                found = path.stat()
            except OSError:
                out.append(f"{rel}: missing (expected {size} bytes)")
                continue
            if not stat.S_ISREG(found.st_mode):
                out.append(f"{rel}: not a regular file (a device, FIFO or directory); not read")
                continue
            actual = found.st_size
            if actual != size:
                out.append(
                    f"{rel}: {actual} bytes, the manifest says {size} (truncated or changed)"
                )
        return out

    def verify(self, directory: Path, *, checksums: bool = False) -> None:
        """Refuse missing or resized files; with ``checksums``, also read every file
        here (one process) and refuse changed bytes."""
        problems = self.problems(directory)
        if checksums and not problems:
            from fsdp_ckpt.checksums import crc32_of

            computed = {rel: crc32_of(directory / rel) for rel in self.checksums}
            problems = self.checksum_problems(directory, computed)
        if problems:
            raise CorruptCheckpointError(
                f"checkpoint {directory} is damaged; refusing to load it: " + "; ".join(problems)
            )

    def checksum_problems(self, directory: Path, computed: dict[str, int]) -> list[str]:
        """Every file among ``computed`` (``{rel: crc32}`` read now) whose checksum
        differs from the recorded one."""
        return [
            f"{rel}: CRC-32 {crc:08x}, the manifest says {self.checksums[rel]:08x} "
            f"(its bytes changed since the save)"
            for rel, crc in sorted(computed.items())
            if rel in self.checksums and crc != self.checksums[rel]
        ]
