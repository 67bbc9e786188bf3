"""The ``ParamAndGradBuffer`` a ``MegatronFSDP`` owns, built from its arguments and
Megatron's ``ddp_config``: what each Megatron-FSDP option means for the buffer (double
buffers, per-token loss scaling, communication units, decoupled gradients)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from fsdp_buffers import GradStaging, MixedPrecisionPolicy, ParamAndGradBuffer, ShardingStrategy
from fsdp_buffers.param_group import resolve_communication_units
from fsdp_buffers.tensor_parallel import TensorParallel
from fsdp_hooks.features.experts import resolve_is_expert_param
from fsdp_hooks.module.config import DistributedDataParallelConfig
from fsdp_hooks.runtime.shared_buckets import warn_if_units_joined_widely

__all__ = ["build_buffer"]


def build_buffer(
    module: nn.Module,
    dist_index,  # fsdp_mesh.FSDPDistributedIndex
    ddp_config: DistributedDataParallelConfig,
    *,
    strategy: ShardingStrategy,
    mixed_precision_policy: MixedPrecisionPolicy,
    fsdp_unit_modules: Iterable[type[nn.Module] | str] | None,
    disable_bucketing: bool,
    device: torch.device,
    fsdp_double_buffer: bool,
    nccl_ub: bool,
    calculate_per_token_loss: bool,
    is_expert_param: Callable[[str, nn.Parameter], bool] | str | None,
    allow_meta: bool,
    tensor_parallel: TensorParallel | None,
    grad_staging: GradStaging,
) -> ParamAndGradBuffer:
    """Move ``module``'s storage into a new ``ParamAndGradBuffer`` laid out as the
    arguments and ``ddp_config`` ask."""
    unit_size, unit_max = resolve_communication_units(
        ddp_config.suggested_communication_unit_size,
        strategy.shards_model_weights,
    )
    buffer = ParamAndGradBuffer(
        module,
        dist_index,
        strategy=strategy,
        mixed_precision_policy=mixed_precision_policy,
        fsdp_unit_modules=fsdp_unit_modules,
        bucket_size=ddp_config.bucket_size,
        disable_bucketing=disable_bucketing,
        device=device,
        # NCCL user buffers need persistent double buffers; off CUDA nccl_ub is
        # ignored (with a warning), and so is what it implies.
        fsdp_double_buffer=fsdp_double_buffer
        or ddp_config.fsdp_double_buffer
        or ((nccl_ub or ddp_config.nccl_ub) and device.type == "cuda"),
        # A per-token loss is normalized by the caller: sum, do not average.
        gradient_scaling_factor=1.0 if calculate_per_token_loss else None,
        expert_gradient_scaling_factor=1.0 if calculate_per_token_loss else None,
        average_in_collective=ddp_config.average_in_collective,
        is_expert_param=resolve_is_expert_param(is_expert_param, dist_index.has_expert_mesh),
        allow_meta=allow_meta,
        tensor_parallel=tensor_parallel,
        communication_unit_size=unit_size,
        communication_unit_max_units=unit_max,
        grad_staging=grad_staging,
    )
    if ddp_config.suggested_communication_unit_size:
        warn_if_units_joined_widely(buffer, ddp_config.suggested_communication_unit_size)
    if ddp_config.megatron_fsdp_use_decoupled_grad:
        # Megatron-FSDP's precision-aware path: the reduced gradient shard goes
        # to .decoupled_grad in the main grads' dtype, .grad stays None.
        buffer.views.grad_attr = "decoupled_grad"
    return buffer
