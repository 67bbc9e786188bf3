"""fsdp-hooks: when the bytes move.

The ``MegatronFSDP`` wrapper and its hooks (gather before use, release after, reduce
as gradients arrive), ``TrainingState``, and the ``fully_shard`` API that takes
Megatron-FSDP's keyword arguments, and the Megatron-Core style adapters
``FullyShardedDataParallel`` and ``DistributedDataParallel`` with
``finalize_model_grads``.
"""

from importlib.metadata import version as _version

from fsdp_hooks.diagnostics.summary import unit_summary
from fsdp_hooks.features.experts import (
    DEFAULT_EXPERT_PATTERN,
    default_is_expert_param,
    mark_expert_params,
)
from fsdp_hooks.fully_shard import fully_shard, fully_shard_model, fully_shard_optimizer
from fsdp_hooks.integrations.huggingface import from_pretrained, save_pretrained
from fsdp_hooks.integrations.megatron_core import (
    DistributedDataParallel,
    FullyShardedDataParallel,
    finalize_model_grads,
)
from fsdp_hooks.module.config import DistributedDataParallelConfig
from fsdp_hooks.module.megatron_compat import find_megatron_fsdp
from fsdp_hooks.module.megatron_fsdp import MegatronFSDP
from fsdp_hooks.runtime.training_state import TrainingState

__version__ = _version("fsdp-hooks")

__all__ = [
    "DEFAULT_EXPERT_PATTERN",
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "FullyShardedDataParallel",
    "MegatronFSDP",
    "TrainingState",
    "__version__",
    "default_is_expert_param",
    "finalize_model_grads",
    "find_megatron_fsdp",
    "from_pretrained",
    "fully_shard",
    "fully_shard_model",
    "fully_shard_optimizer",
    "mark_expert_params",
    "save_pretrained",
    "unit_summary",
]
