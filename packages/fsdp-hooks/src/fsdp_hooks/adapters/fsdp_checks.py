"""Configuration checks of the ``FullyShardedDataParallel`` adapter.

They run before any collective, so a bad configuration raises the same error on every
rank (and without torch.distributed initialized at all). The rules are Megatron-FSDP's.
"""

from __future__ import annotations

from fsdp_buffers import ShardingStrategy
from fsdp_hooks.config import DistributedDataParallelConfig

__all__ = ["check_fsdp_config"]

_INNER = ", ".join(repr(s.megatron_name) for s in ShardingStrategy)
_OUTER = (ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM)


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
    if outer not in _OUTER:
        raise ValueError(
            f"FullyShardedDataParallel: ddp_config.outer_dp_sharding_strategy="
            f"{ddp_config.outer_dp_sharding_strategy!r} is not allowed across the outer "
            "(replica) dim; allowed: 'no_shard', 'optim'"
        )
    instances = ddp_config.num_distributed_optimizer_instances
    if not isinstance(instances, int) or isinstance(instances, bool) or instances < 1:
        raise ValueError(
            "FullyShardedDataParallel: ddp_config.num_distributed_optimizer_instances must be "
            f"a positive int (1 = no hybrid sharding); got {instances!r}"
        )
    if outer is ShardingStrategy.OPTIM and inner is not ShardingStrategy.OPTIM_GRADS_PARAMS:
        raise ValueError(
            "FullyShardedDataParallel: outer_dp_sharding_strategy='optim' (fully-sharded "
            "HSDP) needs data_parallel_sharding_strategy='optim_grads_params'; got "
            f"{inner.megatron_name!r}. Use 'optim_grads_params', or outer 'no_shard'"
        )
    if outer is ShardingStrategy.OPTIM and instances == 1:
        raise ValueError(
            "FullyShardedDataParallel: outer_dp_sharding_strategy='optim' applies to hybrid "
            "sharding, which needs num_distributed_optimizer_instances > 1; got 1"
        )
    if init_model_with_meta_device and inner is ShardingStrategy.NO_SHARD:
        raise ValueError(
            "FullyShardedDataParallel: meta-device initialization "
            "(config.init_model_with_meta_device=True) is not allowed with "
            "data_parallel_sharding_strategy='no_shard'; use a sharded strategy ('optim', "
            "'optim_grads', 'optim_grads_params') or materialize the model first"
        )
    return inner
