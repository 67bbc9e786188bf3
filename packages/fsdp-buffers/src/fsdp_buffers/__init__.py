"""fsdp-buffers: where the bytes live and how they move.

Parameter grouping (``ParameterGroup``), the shard layout (``compute_layout``),
sharded or replicated storage (``DataParallelBuffer``), one bucket's buffers, state and
collectives (``Bucket``), every bucket as a sharding strategy asks
(``ParamAndGradBuffer``), the collective pipelines
(``AllGatherPipeline``, ``GradReducePipeline``), mixed precision
(``MixedPrecisionPolicy``), ``fsdp_no_shard`` and scratch memory. No module hooks: a
framework with its own training loop can use this layer alone (see
``examples/standalone_loop.py``).
"""

from importlib.metadata import version as _version

from fsdp_buffers.all_gather_pipeline import AllGatherPipeline, BucketStatus, PrefetchOrder
from fsdp_buffers.bucket import Bucket, GradState, GroupSharding
from fsdp_buffers.collectives import CollectiveKind, CommStats, PendingCollective
from fsdp_buffers.data_parallel_buffer import (
    BucketAllocator,
    DataParallelBuffer,
    DoubleBufferAllocator,
    TemporaryBucketAllocator,
)
from fsdp_buffers.grad_reduce_pipeline import GradReducePipeline
from fsdp_buffers.layout import DEFAULT_ALIGNMENT, FlatLayout, ParamSlot, compute_layout
from fsdp_buffers.memory_pool import GlobalMemoryBuffer, get_global_memory_buffer
from fsdp_buffers.mixed_precision import MixedPrecisionPolicy
from fsdp_buffers.no_shard import (
    FSDP_PARAM_ATTRIBUTES,
    copy_param_attributes,
    fsdp_no_shard,
    fsdp_whole_placement,
    is_fsdp_no_shard,
    module_is_fully_no_shard,
)
from fsdp_buffers.param_and_grad_buffer import ParamAndGradBuffer
from fsdp_buffers.param_group import (
    DEFAULT_BUCKET_SIZE,
    ParameterGroup,
    find_fsdp_units,
    group_parameters,
    resolve_unit_classes,
    tied_parameter_names,
)
from fsdp_buffers.profiling import annotate
from fsdp_buffers.strategy import ShardingStrategy
from fsdp_buffers.tensor_parallel import TPKind, TPSpec, tensor_parallel_specs

__version__ = _version("fsdp-buffers")

__all__ = [
    "DEFAULT_ALIGNMENT",
    "DEFAULT_BUCKET_SIZE",
    "FSDP_PARAM_ATTRIBUTES",
    "AllGatherPipeline",
    "Bucket",
    "BucketAllocator",
    "BucketStatus",
    "CollectiveKind",
    "CommStats",
    "DataParallelBuffer",
    "DoubleBufferAllocator",
    "FlatLayout",
    "GlobalMemoryBuffer",
    "GradReducePipeline",
    "GradState",
    "GroupSharding",
    "MixedPrecisionPolicy",
    "ParamAndGradBuffer",
    "ParamSlot",
    "ParameterGroup",
    "PendingCollective",
    "PrefetchOrder",
    "ShardingStrategy",
    "TPKind",
    "TPSpec",
    "TemporaryBucketAllocator",
    "__version__",
    "annotate",
    "compute_layout",
    "copy_param_attributes",
    "find_fsdp_units",
    "fsdp_no_shard",
    "fsdp_whole_placement",
    "get_global_memory_buffer",
    "group_parameters",
    "is_fsdp_no_shard",
    "module_is_fully_no_shard",
    "resolve_unit_classes",
    "tensor_parallel_specs",
    "tied_parameter_names",
]
