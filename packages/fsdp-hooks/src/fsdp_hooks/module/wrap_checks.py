"""What ``MegatronFSDP`` does before its module's storage moves into buffers: its
arguments checked (bad input raises on every rank before any collective, Note [option
types] in ``setup.validation``), its settings resolved from them and Megatron's
``ddp_config``, the module moved to the device, and the ranks agreed on the model
(``check_same_model``; initial values that differ are broadcast from data-parallel rank
0, as torch DDP does)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_buffers import GradStaging, MixedPrecisionPolicy, ShardingStrategy
from fsdp_buffers.tensor_parallel import TensorParallel
from fsdp_hooks.features.experts import resolve_is_expert_param
from fsdp_hooks.module.config import DistributedDataParallelConfig
from fsdp_hooks.module.megatron_compat import default_ddp_config
from fsdp_hooks.module.unused_options import options_set, warn_unused_options
from fsdp_hooks.setup.validation import (
    broadcast_from_dp_rank0,
    check_argument_types,
    check_hybrid_index,
    check_not_wrapped,
    check_option_types,
    check_param_dtype,
    check_same_model,
    check_tensor_parallel_replicas,
)
from fsdp_mesh import current_device

__all__ = ["WrapSettings", "check_and_resolve"]


@dataclass(frozen=True)
class WrapSettings:
    """``MegatronFSDP``'s arguments, checked and resolved."""

    ddp_config: DistributedDataParallelConfig
    device: torch.device
    strategy: ShardingStrategy
    outer_strategy: ShardingStrategy
    mixed_precision_policy: MixedPrecisionPolicy
    grad_staging: GradStaging
    tensor_parallel: TensorParallel


def check_and_resolve(
    module: nn.Module,
    dist_index,  # fsdp_mesh.FSDPDistributedIndex
    ddp_config: DistributedDataParallelConfig | None,
    mixed_precision_policy: MixedPrecisionPolicy | None,
    fsdp_unit_modules: Iterable[type[nn.Module] | str] | None,
    options: Mapping[str, Any],
    *,
    signature: Callable[..., Any],
    fine_grained_recurse_module_types: tuple[type[nn.Module], ...] | None,
    is_expert_param: Callable[[str, nn.Parameter], bool] | str | None,
    grad_staging: GradStaging | str,
) -> WrapSettings:
    """Check ``MegatronFSDP``'s arguments, resolve its settings, move ``module`` to the
    device and agree on it across the data-parallel ranks. ``options``: the wrapper's
    scalar options by name, their types checked against ``signature``'s annotations."""
    check_argument_types(
        "MegatronFSDP",
        module,
        fsdp_unit_modules,
        mixed_precision_policy=(
            mixed_precision_policy,
            MixedPrecisionPolicy,
            "MixedPrecisionPolicy(main_params_dtype=torch.float32)",
        ),
    )
    # Note [option types]: before any collective, alike on every rank
    check_option_types("MegatronFSDP", signature, options)
    if ddp_config is not None:  # Megatron-Core's too, or one changed since it was built
        DistributedDataParallelConfig.check_fields(ddp_config, "MegatronFSDP: ddp_config")
    check_not_wrapped(module)
    grad_staging = GradStaging.parse(grad_staging)  # bad input: before anything changes
    if ddp_config is None:
        ddp_config = default_ddp_config(
            options["keep_fp8_transpose_cache"],
            options["nccl_ub"],
            options["fsdp_double_buffer"],
            options["disable_symmetric_registration"],
        )
    device_arg = options["device"]
    device = (
        torch.device(device_arg)
        if device_arg is not None
        else current_device(dist_index.device_type)
    )
    warn_unused_options(
        device,
        "MegatronFSDP",
        options_set(
            ddp_config,
            nccl_ub=options["nccl_ub"],
            disable_symmetric_registration=options["disable_symmetric_registration"],
            keep_fp8_transpose_cache=options["keep_fp8_transpose_cache"],
            fsdp_db_use_persist_buf_on_alloc_fail=options["fsdp_db_use_persist_buf_on_alloc_fail"],
            enable_fine_grained_param_gather_hook=options["enable_fine_grained_param_gather_hook"],
            enable_fine_grained_param_gather_backward_hook=(
                options["enable_fine_grained_param_gather_backward_hook"]
            ),
            fine_grained_recurse_module_types=fine_grained_recurse_module_types,
        ),
    )
    strategy = ShardingStrategy.parse(ddp_config.data_parallel_sharding_strategy)
    outer_strategy = ShardingStrategy.parse(ddp_config.outer_dp_sharding_strategy)
    meta_init = options["init_model_with_meta_device"]
    check_hybrid_index(dist_index, strategy, outer_strategy, meta_init)
    policy = mixed_precision_policy or MixedPrecisionPolicy(
        main_params_dtype=ddp_config.megatron_fsdp_main_params_dtype,
        main_grads_dtype=ddp_config.megatron_fsdp_main_grads_dtype,
        grad_comm_dtype=ddp_config.megatron_fsdp_grad_comm_dtype,
    )
    check_param_dtype(module, policy)
    # Meta parameters without init_model_with_meta_device: FSDP2's route, the model's
    # own init after wrapping (Note [the model's init_weights] in meta_init).
    if not any(p.device.type == "meta" for p in module.parameters()):
        module.to(device)
    split_experts = dist_index.expt_dp_size != dist_index.dp_size
    differ = check_same_model(
        module,
        dist_index,
        {
            "ddp_config": ddp_config,
            "fsdp_unit_modules": fsdp_unit_modules,
            "disable_bucketing": options["disable_bucketing"],
            "device": device.type,
            "calculate_per_token_loss": options["calculate_per_token_loss"],
            "init_model_with_meta_device": meta_init,
            "sync_model_each_microbatch": options["sync_model_each_microbatch"],
            "keep_fp8_transpose_cache": options["keep_fp8_transpose_cache"],
            "nccl_ub": options["nccl_ub"],
            "fsdp_double_buffer": options["fsdp_double_buffer"],
            "disable_symmetric_registration": options["disable_symmetric_registration"],
            "mixed_precision_policy": policy,
            "is_expert_param": is_expert_param,
            "prefetch_depth": options["prefetch_depth"],
            "regather_saved_weights": options["regather_saved_weights"],
        },
        # Experts differ across ranks on an expert-parallel mesh.
        skip_values=resolve_is_expert_param(is_expert_param, True) if split_experts else None,
    )
    if differ:
        broadcast_from_dp_rank0(module, differ, dist_index)
    return WrapSettings(
        ddp_config=ddp_config,
        device=device,
        strategy=strategy,
        outer_strategy=outer_strategy,
        mixed_precision_policy=policy,
        grad_staging=grad_staging,
        tensor_parallel=check_tensor_parallel_replicas(module, dist_index),
    )
