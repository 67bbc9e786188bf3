"""fsdp_ckpt: How state leaves and comes back: DTensor checkpoints."""

from importlib.metadata import version as _version

__version__ = _version("fsdp-ckpt")
__all__ = ["__version__"]
