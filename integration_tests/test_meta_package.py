"""The ``fsdp`` meta-package: every layer's public names, and the layers' versions."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import fsdp

LAYERS = ("fsdp_mesh", "fsdp_buffers", "fsdp_hooks", "fsdp_ckpt", "fsdp_plan")


@pytest.mark.parametrize("layer", LAYERS)
def test_reexports_every_public_name_of_each_layer(layer):
    module = importlib.import_module(layer)
    for name in module.__all__:
        if name == "__version__":
            continue
        assert name in fsdp.__all__, f"fsdp does not list {layer}.{name}"
        assert getattr(fsdp, name) is getattr(module, name), f"fsdp.{name} is not {layer}'s"


def test_versions_of_every_layer():
    versions = fsdp.versions()
    for dist in (
        "fsdp", "fsdp-mesh", "fsdp-buffers", "fsdp-hooks", "fsdp-ckpt", "fsdp-plan", "torch"
    ):  # fmt: skip
        assert versions[dist] not in ("", "not installed"), versions
    assert versions["fsdp"] == fsdp.__version__
    out = subprocess.run(
        [sys.executable, "-m", "fsdp"], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert "fsdp-hooks" in out and fsdp.__version__ in out, out
