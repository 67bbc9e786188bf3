"""The effective configuration of ``DistributedDataParallel`` and its checks.

In Megatron-Core the options live on ``ddp_config``; the older constructor took them as
keywords. Both are accepted: a keyword given (not None) overrides the ``ddp_config``
field, and the result is ``model.ddp_config``. Every check runs before any collective,
so a bad configuration raises the same error on every rank.
"""

from __future__ import annotations

import dataclasses

from fsdp_buffers import ShardingStrategy
from fsdp_hooks.integrations.megatron_core._common import coerce_ddp_config
from fsdp_hooks.module.config import DistributedDataParallelConfig
from fsdp_hooks.setup.validation import check_option_types

__all__ = ["effective_ddp_config"]

WHO = "DistributedDataParallel"


def effective_ddp_config(
    ddp_config: object,
    *,
    accumulate_allreduce_grads_in_fp32: bool | None,
    overlap_grad_reduce: bool | None,
    use_distributed_optimizer: bool | None,
    check_for_nan_in_grad: bool | None,
) -> DistributedDataParallelConfig:
    cfg = coerce_ddp_config(ddp_config, WHO)
    keywords = {
        "accumulate_allreduce_grads_in_fp32": accumulate_allreduce_grads_in_fp32,
        "overlap_grad_reduce": overlap_grad_reduce,
        "use_distributed_optimizer": use_distributed_optimizer,
        "check_for_nan_in_grad": check_for_nan_in_grad,
    }
    check_option_types(WHO, effective_ddp_config, keywords)  # Note [option types]
    overrides = {
        "grad_reduce_in_fp32": accumulate_allreduce_grads_in_fp32,
        "overlap_grad_reduce": overlap_grad_reduce,
        "use_distributed_optimizer": use_distributed_optimizer,
        "check_for_nan_in_grad": check_for_nan_in_grad,
    }
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if cfg.use_megatron_fsdp:
        raise ValueError(
            f"{WHO}: ddp_config.use_megatron_fsdp=True asks for Megatron-FSDP; build the "
            "model with FullyShardedDataParallel(config, ddp_config, module) instead"
        )
    try:
        strategy = ShardingStrategy.parse(cfg.data_parallel_sharding_strategy)
    except ValueError as err:
        raise ValueError(f"{WHO}: ddp_config.data_parallel_sharding_strategy: {err}") from None
    if strategy >= ShardingStrategy.OPTIM_GRADS:
        raise ValueError(
            f"{WHO}: data_parallel_sharding_strategy={strategy.megatron_name!r} shards "
            "gradients or weights, which DistributedDataParallel never does (it keeps "
            "whole replicated parameters); use FullyShardedDataParallel for "
            "'optim_grads'/'optim_grads_params', or leave the strategy 'no_shard' here"
        )
    if strategy is ShardingStrategy.OPTIM and not cfg.use_distributed_optimizer:
        raise ValueError(
            f"{WHO}: data_parallel_sharding_strategy='optim' means a distributed "
            "optimizer; set use_distributed_optimizer=True (or the strategy 'no_shard')"
        )
    if cfg.num_distributed_optimizer_instances != 1:
        raise NotImplementedError(
            f"{WHO}: num_distributed_optimizer_instances="
            f"{cfg.num_distributed_optimizer_instances!r}: partial distributed optimizers "
            "(hybrid sharding) are not implemented yet; use 1"
        )
    if cfg.bucket_size is not None and cfg.bucket_size < 1:
        raise ValueError(
            f"{WHO}: ddp_config.bucket_size must be a positive number of elements or None; "
            f"got {cfg.bucket_size!r}"
        )
    strategy = (
        ShardingStrategy.OPTIM if cfg.use_distributed_optimizer else ShardingStrategy.NO_SHARD
    )
    cfg.data_parallel_sharding_strategy = strategy.megatron_name
    return cfg
