"""fsdp: Fully Sharded Data Parallel for PyTorch, one import for what users call.

``fully_shard`` and its friends, the Megatron-Core style adapters, the policies, the
checkpoint functions, ``from_pretrained``/``save_pretrained`` and ``plan`` (per-rank
bytes before launch). ``fsdp.versions()`` (or ``python -m fsdp``) tells the version of
each layer. The demo command ``fsdp-demo`` lives in ``fsdp.demo``.

Internals stay importable from their layer: ``fsdp_mesh`` (who talks to whom),
``fsdp_buffers`` (where the bytes live and how they move), ``fsdp_hooks`` (when the
bytes move), ``fsdp_ckpt`` (checkpoints) and ``fsdp_plan`` (planning), e.g.
``from fsdp_buffers import ParamAndGradBuffer``.
"""

from importlib.metadata import version as _version

from fsdp._versions import versions
from fsdp_buffers import (
    AllGatherPipeline,
    DataParallelBuffer,
    GradReducePipeline,
    MixedPrecisionPolicy,
    ParameterGroup,
    ShardingStrategy,
    fsdp_no_shard,
)
from fsdp_ckpt import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    ForeignCheckpointWarning,
    HostStager,
    IncompleteCheckpointError,
    SaveHandle,
    consolidate_checkpoint,
    get_full_model_state_dict,
    get_model_state_dict,
    get_optimizer_state_dict,
    load_checkpoint,
    load_full_state_dict,
    save_checkpoint,
    save_full_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from fsdp_hooks import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
    MegatronFSDP,
    TrainingState,
    finalize_model_grads,
    from_pretrained,
    fully_shard,
    fully_shard_model,
    fully_shard_optimizer,
    save_pretrained,
)
from fsdp_mesh import FSDPDistributedIndex, build_device_mesh
from fsdp_plan import Plan, plan

__version__ = _version("fsdp")

# Written out, not gathered from the layers' lists: what a user calls, and no more
# (FSDP2's public surface is about as small). Internals stay in their layer.
__all__ = [  # noqa: RUF022 (grouped by what users do, not sorted)
    # Wrapping, with Megatron-FSDP's names
    "DistributedDataParallelConfig",
    "FSDPDistributedIndex",
    "MegatronFSDP",
    "MixedPrecisionPolicy",
    "ShardingStrategy",
    "TrainingState",
    "build_device_mesh",
    "fsdp_no_shard",
    "fully_shard",
    "fully_shard_model",
    "fully_shard_optimizer",
    # Megatron-Core style adapters
    "DistributedDataParallel",
    "FullyShardedDataParallel",
    "finalize_model_grads",
    # Buckets and their pipelines, as Megatron-FSDP names them
    "AllGatherPipeline",
    "DataParallelBuffer",
    "GradReducePipeline",
    "ParameterGroup",
    # Checkpoints
    "CheckpointError",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "ForeignCheckpointWarning",
    "HostStager",
    "IncompleteCheckpointError",
    "SaveHandle",
    "consolidate_checkpoint",
    "get_full_model_state_dict",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "load_checkpoint",
    "load_full_state_dict",
    "save_checkpoint",
    "save_full_model_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    # Hugging Face models
    "from_pretrained",
    "save_pretrained",
    # Before launch, and versions
    "Plan",
    "__version__",
    "plan",
    "versions",
]
