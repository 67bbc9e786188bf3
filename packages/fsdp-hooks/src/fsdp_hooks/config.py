"""``DistributedDataParallelConfig``: Megatron-FSDP's standalone DDP configuration.

Field names and defaults follow the ``megatron_fsdp`` package's copy of Megatron-Core's
config, so a config written for it works here unchanged. It does not depend on
Megatron-Core. Fields that only mean something with CUDA/NCCL (``nccl_ub``,
``disable_symmetric_registration``, ``keep_fp8_transpose_cache``, ``fp8_param_gather``,
``fsdp_manual_registration``, the cuda-graph flags) are accepted everywhere and ignored
on CPU with one warning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DistributedDataParallelConfig"]


@dataclass
class DistributedDataParallelConfig:
    overlap_grad_reduce: bool = False
    """Overlap gradient reduction with backward compute (buckets reduce as they fill)."""
    overlap_param_gather: bool = False
    """Overlap parameter gathers with forward compute (prefetch the next unit)."""
    check_for_nan_in_grad: bool = False
    """Raise, on every rank, if a local gradient holds NaN or Inf, naming the parameters."""
    bucket_size: int | None = None
    """Elements per bucket for parameters outside FSDP units (default 40M)."""
    average_in_collective: bool = False
    """Average inside the collective (ReduceOp.AVG) instead of pre-dividing by dp size."""
    fp8_param_gather: bool = False
    data_parallel_sharding_strategy: str = "no_shard"
    """'no_shard', 'optim', 'optim_grads' or 'optim_grads_params' (or 0..3)."""
    gradient_reduce_div_fusion: bool = True
    suggested_communication_unit_size: int | None = None
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    """Keep gathered buckets in two persistent slots instead of allocating per use."""
    fsdp_all_gather_in_start_param_sync: bool = True
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False
    outer_dp_sharding_strategy: str = "no_shard"
    """Strategy across the outer (replica) dim of hybrid sharding: 'no_shard' or 'optim'."""
    disable_symmetric_registration: bool = False
    fsdp_manual_registration: bool = False
    megatron_fsdp_main_params_dtype: torch.dtype | None = torch.float32
    megatron_fsdp_main_grads_dtype: torch.dtype | None = None
    megatron_fsdp_grad_comm_dtype: torch.dtype | None = None
    megatron_fsdp_use_decoupled_grad: bool = False
    megatron_fsdp_cuda_graph_mode: bool = False
    megatron_fsdp_enable_fine_grained_param_gather: bool = False
    megatron_fsdp_max_pool_double_buffer: bool = False
    # Megatron-Core DistributedDataParallel fields (used by the DDP adapter).
    grad_reduce_in_fp32: bool = False
    use_distributed_optimizer: bool = False
    num_distributed_optimizer_instances: int = 1
    use_megatron_fsdp: bool = False

    def __post_init__(self) -> None:
        if self.megatron_fsdp_max_pool_double_buffer:
            self.fsdp_double_buffer = True
        # nccl_ub implies fsdp_double_buffer (NCCL user buffers need persistent
        # communication buffers) only on CUDA, where it has an effect: MegatronFSDP
        # decides, once it knows the device.
