"""fsdp-buffers: where the bytes live and how they move.

Parameter grouping (``ParameterGroup``), the shard layout (``compute_layout``),
sharded or replicated storage (``DataParallelBuffer``), one bucket's buffers, state and
collectives (``Bucket``), every bucket as a sharding strategy asks
(``ParamAndGradBuffer``), the collective pipelines
(``AllGatherPipeline``, ``GradReducePipeline``), mixed precision
(``MixedPrecisionPolicy``), ``fsdp_no_shard`` and scratch memory. No module hooks: a
framework with its own training loop can use this layer alone (see
``examples/standalone_loop.py``).

``__all__`` lists what such a framework calls. The parts other layers build with
(allocators, per-bucket state enums, collectives, tensor-parallel specs, memory pools,
unit discovery) are imported from their module, e.g.
``from fsdp_buffers.bucket import GradState``.
"""

from importlib.metadata import version as _version

from fsdp_buffers.all_gather_pipeline import AllGatherPipeline, BucketStatus, PrefetchOrder
from fsdp_buffers.bucket import Bucket
from fsdp_buffers.bucket_state import GradStaging
from fsdp_buffers.data_parallel_buffer import DataParallelBuffer
from fsdp_buffers.grad_reduce_pipeline import GradReducePipeline
from fsdp_buffers.layout import FlatLayout
from fsdp_buffers.mixed_precision import MixedPrecisionPolicy
from fsdp_buffers.no_shard import (
    fsdp_no_shard,
    fsdp_whole_placement,
    is_fsdp_no_shard,
    module_is_fully_no_shard,
)
from fsdp_buffers.param_and_grad_buffer import ParamAndGradBuffer
from fsdp_buffers.param_group import DEFAULT_BUCKET_SIZE, ParameterGroup
from fsdp_buffers.profiling import annotate
from fsdp_buffers.slot_placement import compute_layout
from fsdp_buffers.strategy import ShardingStrategy

__version__ = _version("fsdp-buffers")

__all__ = [
    "DEFAULT_BUCKET_SIZE",
    "AllGatherPipeline",
    "Bucket",
    "BucketStatus",
    "DataParallelBuffer",
    "FlatLayout",
    "GradReducePipeline",
    "GradStaging",
    "MixedPrecisionPolicy",
    "ParamAndGradBuffer",
    "ParameterGroup",
    "PrefetchOrder",
    "ShardingStrategy",
    "__version__",
    "annotate",
    "compute_layout",
    "fsdp_no_shard",
    "fsdp_whole_placement",
    "is_fsdp_no_shard",
    "module_is_fully_no_shard",
]
