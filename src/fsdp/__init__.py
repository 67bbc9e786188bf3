"""fsdp: Fully Sharded Data Parallel for PyTorch, one import for every layer."""

from importlib.metadata import version as _version

__version__ = _version("fsdp")
__all__ = ["__version__"]
