"""fsdp-mesh: who talks to whom.

Process groups indexed over a DeviceMesh (:class:`FSDPDistributedIndex`), DeviceMesh
and module helpers, the tensor-parallel RNG tracker, device/backend helpers and
version checks for optional dependencies. The multi-process test harness lives in
``fsdp_mesh.testing`` and is not imported here.
"""

from importlib import metadata as _metadata

from fsdp_mesh.device import backend_for_device, current_device, default_device_type
from fsdp_mesh.distributed_index import FSDPDistributedIndex
from fsdp_mesh.mesh_utils import (
    DP_OUTER_DIM,
    DP_SHARD_DIM,
    EP_DIM,
    TP_DIM,
    FSDPMeshes,
    build_device_mesh,
    contains_submesh,
    create_updated_function_signature,
    get_mesh_names,
    is_submodule,
)
from fsdp_mesh.rng import (
    EXPERT_PARALLEL_RNG_TRACKER_NAME,
    MODEL_PARALLEL_RNG_TRACKER_NAME,
    RNGStatesTracker,
    get_cuda_rng_tracker,
    get_rng_tracker,
    initialize_rng_tracker,
    model_parallel_seed,
)
from fsdp_mesh.tensor_parallel import (
    get_mcore_tensor_parallel_partition_dim,
    is_mcore_tensor_model_parallel,
    is_mcore_tensor_parallel_duplicated,
)
from fsdp_mesh.utils import log_single_rank, safe_get_rank, using_tensor_parallel
from fsdp_mesh.versions import (
    ReleaseVersion,
    get_te_version,
    get_torch_version,
    is_te_min_version,
    is_torch_min_version,
    parse_version,
)

try:
    __version__ = _metadata.version("fsdp-mesh")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "DP_OUTER_DIM",
    "DP_SHARD_DIM",
    "EP_DIM",
    "EXPERT_PARALLEL_RNG_TRACKER_NAME",
    "MODEL_PARALLEL_RNG_TRACKER_NAME",
    "TP_DIM",
    "FSDPDistributedIndex",
    "FSDPMeshes",
    "RNGStatesTracker",
    "ReleaseVersion",
    "__version__",
    "backend_for_device",
    "build_device_mesh",
    "contains_submesh",
    "create_updated_function_signature",
    "current_device",
    "default_device_type",
    "get_cuda_rng_tracker",
    "get_mcore_tensor_parallel_partition_dim",
    "get_mesh_names",
    "get_rng_tracker",
    "get_te_version",
    "get_torch_version",
    "initialize_rng_tracker",
    "is_mcore_tensor_model_parallel",
    "is_mcore_tensor_parallel_duplicated",
    "is_submodule",
    "is_te_min_version",
    "is_torch_min_version",
    "log_single_rank",
    "model_parallel_seed",
    "parse_version",
    "safe_get_rank",
    "using_tensor_parallel",
]
