"""fsdp_hooks: When the bytes move: module hooks, training state and the fully_shard API."""

from importlib.metadata import version as _version

__version__ = _version("fsdp-hooks")
__all__ = ["__version__"]
