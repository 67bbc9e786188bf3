"""The ``ParamAndGradBuffer`` a ``MegatronFSDP`` owns, built from its arguments and
Megatron's ``ddp_config``: what each Megatron-FSDP option means for the buffer (double
buffers, per-token loss scaling, communication units, decoupled gradients)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch
from torch import nn

from fsdp_buffers import GradStaging, MixedPrecisionPolicy, ParamAndGradBuffer, ShardingStrategy
from fsdp_buffers.param_group import resolve_communication_units
from fsdp_buffers.tensor_parallel import TensorParallel
from fsdp_hooks.features.experts import resolve_is_expert_param
from fsdp_hooks.module.config import DistributedDataParallelConfig

__all__ = ["build_buffer"]

# A communication unit holding more than this share of the units' parameters is reported
# at wrap: its units are gathered and held together, which ZeRO-3 is meant to avoid.
_WIDE_GROUP_SHARE = 0.5


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


def warn_if_units_joined_widely(buffer: ParamAndGradBuffer, size: int) -> None:
    """Warn (the same on every rank) when ``suggested_communication_unit_size=size``
    joined several units into a communication unit holding more than half of the
    parameters in units: under ZeRO-3 they are gathered and held together. Megatron-FSDP
    sizes its prefetch with the same option, so a value tuned for it (hundreds of
    millions) makes one group of the whole model here."""
    per_unit: dict[int, int] = {}
    members: dict[int, int] = {}
    for group in buffer.groups:
        if group.fsdp_unit_id is None:
            continue
        n = sum(p.numel() for p in group.params)
        per_unit[group.fsdp_unit_id] = per_unit.get(group.fsdp_unit_id, 0) + n
        members[group.fsdp_unit_id] = len(group.coalesced_unit_ids)
    total = sum(per_unit.values())
    wide = {u: n for u, n in per_unit.items() if members[u] > 1 and n > _WIDE_GROUP_SHARE * total}
    if not wide:
        return
    unit, numel = next(iter(wide.items()))
    warnings.warn(
        f"fsdp: suggested_communication_unit_size={size} joins {members[unit]} FSDP units "
        f"into one communication unit of {numel:,} of the units' {total:,} parameter "
        "elements: they are gathered, held and reduced together, so under ZeRO-3 the "
        "gathered peak is that group's, not one unit's. fsdp uses this option to coalesce "
        "small units (Megatron-FSDP uses it to size its prefetch); pass 0 for one "
        "collective per unit, or None for the default (under ZeRO-3, pairs of units under "
        "65,536 elements)",
        UserWarning,
        stacklevel=4,
    )
