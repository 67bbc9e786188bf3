"""``DistributedDataParallelConfig``: Megatron-FSDP's standalone DDP configuration.

Field names and defaults follow the ``megatron_fsdp`` package's copy of Megatron-Core's
config, so a config written for it works here unchanged. It does not depend on
Megatron-Core. Fields that only mean something with CUDA/NCCL (``nccl_ub``,
``disable_symmetric_registration``, ``keep_fp8_transpose_cache``, ``fp8_param_gather``,
``fsdp_manual_registration``, ``megatron_fsdp_cuda_graph_mode``) are accepted everywhere
and ignored on CPU with one warning per process naming them; fields fsdp accepts but
does not implement say "Ignored" below, and are named in one warning when set (see
``fsdp_hooks.module.unused_options``).

Every field is checked against its annotation at construction (a ``TypeError`` naming
the field: ``"false"`` from a YAML file is not a bool; see Note [option types] in
``fsdp_hooks.setup.validation``), and again at wrap (``check_fields``), which also covers
Megatron-Core's own config and fields changed after construction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fsdp_hooks.setup.validation import check_option_types

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
    """CUDA-only. Ignored: fsdp gathers compute weights in their own dtype (warns when set)."""
    data_parallel_sharding_strategy: str | int = "no_shard"
    """'no_shard', 'optim', 'optim_grads' or 'optim_grads_params' (or 0..3)."""
    gradient_reduce_div_fusion: bool = True
    """Ignored: fsdp divides before the collective (or averages in it, see
    ``average_in_collective``), the same result as the fused NCCL pre-multiply."""
    suggested_communication_unit_size: int | None = None
    """Unit coalescing: consecutive FSDP units (registration order) are gathered and
    reduced as one collective until the group holds at least this many parameter
    elements (None: under ZeRO-3 pairs of units under 65,536 elements, below it up to
    four units under 131,072, ``fsdp_buffers.param_group.resolve_communication_units``;
    0: one collective per
    unit). Megatron-FSDP sizes its prefetch and reduce queue
    with it instead; see ``docs/guide/coalescing.md``."""
    keep_fp8_transpose_cache: bool = False
    """CUDA-only; no FP8 weights in fsdp yet, so nothing to cache."""
    nccl_ub: bool = False
    """CUDA-only: NCCL user buffers. On CUDA fsdp turns ``fsdp_double_buffer`` on for
    it (persistent communication buffers); no buffer registration yet."""
    fsdp_double_buffer: bool = False
    """Keep gathered buckets in two persistent slots instead of allocating per use."""
    fsdp_all_gather_in_start_param_sync: bool = True
    """Ignored: ``start_param_sync`` gathers every sharded bucket (warns when False)."""
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False
    """Ignored: double buffers are allocated once, at wrap (warns when set)."""
    outer_dp_sharding_strategy: str | int = "no_shard"
    """Strategy across the outer (replica) dim of hybrid sharding: 'no_shard' or 'optim'."""
    disable_symmetric_registration: bool = False
    """CUDA-only; fsdp registers no NCCL buffers, so there is nothing to disable."""
    fsdp_manual_registration: bool = False
    """CUDA-only; fsdp registers no NCCL buffers yet."""
    megatron_fsdp_main_params_dtype: torch.dtype | None = torch.float32
    megatron_fsdp_main_grads_dtype: torch.dtype | None = None
    megatron_fsdp_grad_comm_dtype: torch.dtype | None = None
    megatron_fsdp_use_decoupled_grad: bool = False
    """Reduced gradients go to the optimizer parameters' ``.decoupled_grad``, in the main
    grads' dtype (not cast to the main weights'), and ``.grad`` stays None: for
    precision-aware optimizers (TE's ``FusedAdam(use_decoupled_grad=True)``).
    ``fully_shard`` refuses an optimizer without ``use_decoupled_grad=True`` then."""
    megatron_fsdp_cuda_graph_mode: bool = False
    """CUDA-only. Ignored: no CUDA-graph-safe mode yet (warns when set)."""
    megatron_fsdp_enable_fine_grained_param_gather: bool = False
    """Ignored: gathers are per FSDP unit (warns when set)."""
    megatron_fsdp_max_pool_double_buffer: bool = False
    """Turns ``fsdp_double_buffer`` on (fsdp has one double-buffer allocator)."""
    # Megatron-Core DistributedDataParallel fields (used by the DDP adapter).
    grad_reduce_in_fp32: bool = False
    use_distributed_optimizer: bool = False
    num_distributed_optimizer_instances: int = 1
    use_megatron_fsdp: bool = False
    fp4_param_gather: bool = False
    """CUDA-only. Ignored: no FP4 weights (warns when set); Megatron-Core's optimizer reads it."""
    reduce_scatter_with_fp32_accumulation: bool = False
    """Ignored: fsdp reduces in the gradient dtype (warns when set); Megatron-Core's
    buffers read it."""

    def __post_init__(self) -> None:
        self.check_fields(self, "DistributedDataParallelConfig")
        if self.megatron_fsdp_max_pool_double_buffer:
            self.fsdp_double_buffer = True
        # nccl_ub implies fsdp_double_buffer (NCCL user buffers need persistent
        # communication buffers) only on CUDA, where it has an effect: MegatronFSDP
        # decides, once it knows the device.

    @classmethod
    def check_fields(cls, config: object, where: str) -> None:
        """Raise ``TypeError`` for the first field of ``config`` (this class, or any
        object with its field names, e.g. Megatron-Core's config) whose value its
        annotation here does not allow (see Note [option types])."""
        values = {
            f.name: getattr(config, f.name)
            for f in dataclasses.fields(cls)
            if hasattr(config, f.name)
        }
        check_option_types(where, cls, values)
