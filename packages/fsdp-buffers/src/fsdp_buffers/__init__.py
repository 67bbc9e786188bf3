"""fsdp_buffers: Where the bytes live and how they move: sharded flat buffers and collective pipelines."""

from importlib.metadata import version as _version

__version__ = _version("fsdp-buffers")
__all__ = ["__version__"]
