"""Megatron-Core style entry points: ``FullyShardedDataParallel(config, ddp_config,
module)`` over ``MegatronFSDP``, ``DistributedDataParallel`` over fsdp's gradient
buffers, and ``finalize_model_grads``."""

from fsdp_hooks.adapters.ddp import DistributedDataParallel
from fsdp_hooks.adapters.finalize import finalize_model_grads
from fsdp_hooks.adapters.fsdp import FullyShardedDataParallel

__all__ = ["DistributedDataParallel", "FullyShardedDataParallel", "finalize_model_grads"]
