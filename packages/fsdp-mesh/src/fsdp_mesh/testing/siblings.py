"""Test files that reuse another test file's models and helpers.

Test files are no importable package (pytest imports them by path), so a test that builds
on a sibling's model loads the sibling by path, once per process, under one private name:
every test file (and every rank process, which imports its test file again) that asks for
the same sibling gets the same module.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load_sibling"]


def load_sibling(test_file: str, sibling: str) -> ModuleType:
    """The module of ``sibling`` (a file name) in the folder of ``test_file`` (pass
    ``__file__``)."""
    path = Path(test_file).with_name(sibling)
    name = f"_fsdp_sibling_{path.parent.parent.name}_{path.stem}".replace("-", "_")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"load_sibling: cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
