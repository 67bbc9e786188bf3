"""``fsdp.versions()``: the version of every layer, and of what they run on."""

from __future__ import annotations

import platform
from importlib import metadata

__all__ = ["LAYERS", "versions"]

LAYERS = ("fsdp", "fsdp-mesh", "fsdp-buffers", "fsdp-hooks", "fsdp-ckpt", "fsdp-plan")


def versions() -> dict[str, str]:
    """Installed version of each layer's distribution, then torch's and Python's."""
    out = {}
    for name in (*LAYERS, "torch"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    out["python"] = platform.python_version()
    return out
