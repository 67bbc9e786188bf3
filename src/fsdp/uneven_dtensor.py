"""Megatron-FSDP's uneven-DTensor helpers (``megatron_fsdp.uneven_dtensor``): see
``fsdp_ckpt.uneven_dtensor``."""

from fsdp_ckpt.uneven_dtensor import *  # noqa: F403
from fsdp_ckpt.uneven_dtensor import __all__  # noqa: F401
