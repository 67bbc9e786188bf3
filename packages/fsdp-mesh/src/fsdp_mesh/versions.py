"""Version checks: torch's, and Transformer Engine's read from installed metadata only.

Importing Transformer Engine costs seconds and initialises CUDA, so the installed
distribution's metadata is read instead. Versions are compared on their numeric
release segments with a small local parser rather than adding ``packaging`` as a
dependency; a pre-release or dev build sorts just below its final release.

Note [torch range]: the packages declare ``torch>=2.11`` (what the Megatron-Core and
torchtitan containers ship), and CI runs a part of the suite on torch 2.11 beside the
locked torch (``ci/torch-oldest``). Where a newer torch brings something fsdp needs,
the check lives here, once, as a named predicate over :func:`is_torch_min_version`;
its caller raises a clear error or takes a fallback, never a silent difference.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from importlib import metadata

import torch

__all__ = [
    "ReleaseVersion",
    "dtensor_masked_assign_keeps_shard",
    "get_te_version",
    "get_torch_version",
    "is_te_min_version",
    "is_torch_min_version",
    "parse_version",
]

# Transformer Engine has shipped under both spellings.
_TE_DISTRIBUTIONS = ("transformer-engine", "transformer_engine")

_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)(.*)$")
_PRE_RELEASE = re.compile(r"^[.\-_]?(a|alpha|b|beta|c|rc|pre|preview|dev)", re.IGNORECASE)


@functools.total_ordering
@dataclass(frozen=True, eq=False)
class ReleaseVersion:
    """A version reduced to what ordering needs: release numbers and a pre-release flag.

    ``release`` drops trailing zeros so ``2.0`` equals ``2.0.0``. ``final`` is False for
    pre-release and dev builds (``2.1.0rc1``, ``2.1.0.dev0+abc``), which sort below the
    final ``2.1.0``; local labels (``+cu12``) are ignored. Compares with other
    instances and with version strings, as ``packaging.version.Version`` users expect.
    ``str()`` gives the text parsed.
    """

    release: tuple[int, ...]
    final: bool = True
    text: str = field(default="")

    def __str__(self) -> str:
        return self.text or ".".join(map(str, self.release))

    def _key(self) -> tuple[tuple[int, ...], bool]:
        return (self.release, self.final)

    @staticmethod
    def _coerce(other: object) -> ReleaseVersion | None:
        if isinstance(other, ReleaseVersion):
            return other
        if isinstance(other, str):
            return parse_version(other)
        return None

    def __eq__(self, other: object) -> bool:
        o = self._coerce(other)
        return NotImplemented if o is None else self._key() == o._key()

    def __lt__(self, other: object) -> bool:
        o = self._coerce(other)
        return NotImplemented if o is None else self._key() < o._key()

    def __hash__(self) -> int:
        return hash(self._key())


def parse_version(text: str) -> ReleaseVersion:
    """Parse ``"2.8.0"``, ``"1.13.0.dev0+abc"`` or ``"v2.1rc1"`` into a :class:`ReleaseVersion`."""
    match = _RELEASE.match(text)
    if match is None:
        raise ValueError(
            f"Cannot parse version {text!r}: expected numeric release segments such as "
            "'2.8.0', optionally followed by a pre-release or local label."
        )
    release = [int(part) for part in match.group(1).split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    rest = match.group(2).split("+", 1)[0]
    return ReleaseVersion(tuple(release), final=_PRE_RELEASE.match(rest) is None, text=text)


@functools.cache
def get_te_version() -> ReleaseVersion | None:
    """Return the installed Transformer Engine version, or None when it is not installed.

    Cached for the life of the process (call ``get_te_version.cache_clear()`` after
    installing or removing it). Never imports ``transformer_engine``.
    """
    for name in _TE_DISTRIBUTIONS:
        try:
            text = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        try:
            return parse_version(text)
        except ValueError:
            # Unparseable metadata must not break callers that only probe for TE.
            return None
    return None


def is_te_min_version(version: str, check_equality: bool = True) -> bool:
    """Return whether Transformer Engine is installed at ``version`` or newer.

    With ``check_equality=False`` the installed version must be strictly newer. False
    when Transformer Engine is not installed.
    """
    installed = get_te_version()
    if installed is None:
        return False
    wanted = parse_version(version)
    return installed >= wanted if check_equality else installed > wanted


def get_torch_version() -> ReleaseVersion:
    """The running torch's version, from ``torch.__version__`` (a source build may have
    no distribution metadata); its local label (``+cu130``) is ignored."""
    return parse_version(str(torch.__version__))


def is_torch_min_version(version: str, check_equality: bool = True) -> bool:
    """Return whether the running torch is ``version`` or newer (strictly newer with
    ``check_equality=False``). A pre-release (``2.15.0a0+git...``) counts as older
    than its release."""
    installed = get_torch_version()
    wanted = parse_version(version)
    return installed >= wanted if check_equality else installed > wanted


def dtensor_masked_assign_keeps_shard() -> bool:
    """Whether DTensor can assign through a boolean mask in place (``t[mask] = v``,
    ``aten.index_put_``) on a tensor sharded on dim 0, keeping it sharded: from torch
    2.15. Torch 2.11 registers no sharding strategy for ``aten.index_put_``; 2.12-2.14
    register one that needs the tensor replicated, which an in-place op cannot get.
    ``torch.optim.Rprop`` steps this way unless ``capturable``."""
    return is_torch_min_version("2.15")
