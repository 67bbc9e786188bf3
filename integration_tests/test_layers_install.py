"""Every layer installs and imports from the workspace, each with its own version."""

import importlib

import pytest


@pytest.mark.parametrize("name", ["fsdp", "fsdp_mesh", "fsdp_buffers", "fsdp_hooks", "fsdp_ckpt"])
def test_layer_imports(name):
    module = importlib.import_module(name)
    assert module.__version__ == "0.1.0"
