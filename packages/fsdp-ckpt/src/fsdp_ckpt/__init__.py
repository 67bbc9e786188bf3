"""fsdp_ckpt: how state leaves and comes back.

Sharded model and optimizer state dicts for ``torch.distributed.checkpoint`` (DTensors
under the original names; uneven row shards placed at their true offsets), atomic and
verified ``save_checkpoint``/``load_checkpoint`` that reshard across world sizes,
strategies and wrappers (fsdp, PyTorch FSDP2, a plain module), and consolidation to
one full-model file (``fsdp-consolidate``). Works on any module whose state dict holds
DTensors; it does not import ``fsdp_hooks``.
"""

from importlib.metadata import version as _version

from fsdp_ckpt.async_save import SaveHandle
from fsdp_ckpt.checkpoint import load_checkpoint, save_checkpoint
from fsdp_ckpt.consolidate import (
    consolidate_checkpoint,
    get_full_model_state_dict,
    load_full_state_dict,
    save_full_model_state_dict,
    write_state_dict_file,
)
from fsdp_ckpt.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignCheckpointWarning,
    IncompleteCheckpointError,
)
from fsdp_ckpt.model_state import get_model_state_dict, set_model_state_dict
from fsdp_ckpt.optim_state import (
    get_optimizer_state_dict,
    init_optimizer_state,
    set_optimizer_state_dict,
)
from fsdp_ckpt.staging import HostStager

__version__ = _version("fsdp-ckpt")
__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "ForeignCheckpointWarning",
    "HostStager",
    "IncompleteCheckpointError",
    "SaveHandle",
    "__version__",
    "consolidate_checkpoint",
    "get_full_model_state_dict",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "init_optimizer_state",
    "load_checkpoint",
    "load_full_state_dict",
    "save_checkpoint",
    "save_full_model_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "write_state_dict_file",
]
