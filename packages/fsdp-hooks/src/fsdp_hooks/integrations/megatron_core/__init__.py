"""Megatron-Core style entry points: ``FullyShardedDataParallel(config, ddp_config,
module)`` over ``MegatronFSDP``, ``DistributedDataParallel`` over fsdp's gradient
buffers, and ``finalize_model_grads``."""

from fsdp_hooks.integrations.megatron_core.ddp import DistributedDataParallel
from fsdp_hooks.integrations.megatron_core.finalize import finalize_model_grads
from fsdp_hooks.integrations.megatron_core.fsdp import FullyShardedDataParallel

__all__ = ["DistributedDataParallel", "FullyShardedDataParallel", "finalize_model_grads"]
