"""Configuration checks of the ``FullyShardedDataParallel`` adapter.

They run before any collective, so a bad configuration raises the same error on every
rank (and without torch.distributed initialized at all). The rules are Megatron-FSDP's.
"""

from __future__ import annotations

from fsdp_buffers import ShardingStrategy
from fsdp_hooks.module.config import DistributedDataParallelConfig
from fsdp_hooks.setup.validation import check_outer_strategy

__all__ = ["check_fsdp_config"]

_INNER = ", ".join(repr(s.megatron_name) for s in ShardingStrategy)


def _parse(value: object, field: str, allowed: str) -> ShardingStrategy:
    try:
        return ShardingStrategy.parse(value)  # type: ignore[arg-type]
    except ValueError:
        raise ValueError(
            f"FullyShardedDataParallel: ddp_config.{field}={value!r} is not a sharding "
            f"strategy; allowed: {allowed} (or 0..3 / 'zero1'..'zero3' for the inner one)"
        ) from None


def check_fsdp_config(
    ddp_config: DistributedDataParallelConfig, init_model_with_meta_device: bool
) -> ShardingStrategy:
    """Validate the strategies and their combinations; return the inner strategy."""
    inner = _parse(
        ddp_config.data_parallel_sharding_strategy, "data_parallel_sharding_strategy", _INNER
    )
    outer = _parse(
        ddp_config.outer_dp_sharding_strategy, "outer_dp_sharding_strategy", "'no_shard', 'optim'"
    )
    instances = ddp_config.num_distributed_optimizer_instances
    if not isinstance(instances, int) or isinstance(instances, bool) or instances < 1:
        raise ValueError(
            "FullyShardedDataParallel: ddp_config.num_distributed_optimizer_instances must be "
            f"a positive int (1 = no hybrid sharding); got {instances!r}"
        )
    check_outer_strategy(
        inner,
        outer,
        instances > 1,
        "FullyShardedDataParallel",
        "set ddp_config.num_distributed_optimizer_instances > 1 (hybrid sharding)",
    )
    if init_model_with_meta_device and inner is ShardingStrategy.NO_SHARD:
        raise ValueError(
            "FullyShardedDataParallel: meta-device initialization "
            "(config.init_model_with_meta_device=True) is not allowed with "
            "data_parallel_sharding_strategy='no_shard'; use a sharded strategy ('optim', "
            "'optim_grads', 'optim_grads_params') or materialize the model first"
        )
    return inner
