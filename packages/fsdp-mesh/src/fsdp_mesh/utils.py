"""Small helpers Megatron-FSDP users import from ``megatron_fsdp.utils``."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist

from fsdp_mesh.mesh_utils import get_mesh_names

__all__ = ["log_single_rank", "safe_get_rank", "using_tensor_parallel"]


def safe_get_rank() -> int:
    """This process's rank: torch.distributed's when initialized, else the ``RANK``
    environment variable, else 0 (also when ``RANK`` is not an integer)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", 0))
    except (TypeError, ValueError):
        return 0


def log_single_rank(
    logger_: logging.Logger, level: int, msg: str, *args: Any, rank: int = 0, **kwargs: Any
) -> None:
    """``logger_.log(level, msg, ...)`` on rank ``rank`` only (``safe_get_rank``)."""
    if safe_get_rank() == rank:
        logger_.log(level, msg, *args, **kwargs)


def using_tensor_parallel(dist_index: Any, is_expert_parallel: bool = False) -> bool:
    """Whether the (expert) mesh of ``dist_index`` has a tensor-parallel dim of more
    than one rank.

    ``dist_index`` is ours or any index megatron_fsdp's ``using_tensor_parallel``
    accepts: it reads only ``tp_dim`` and ``get_submesh(tp_dim, is_expert_parallel=...)``.
    Where the index can say which dims its (expert) mesh has (our ``get_root_mesh``),
    an expert mesh without the tp dim is expert tp of size 1 rather than an error."""
    tp_dim = dist_index.tp_dim
    if tp_dim is None:
        return False
    root_mesh = getattr(dist_index, "get_root_mesh", None)
    if callable(root_mesh) and tp_dim not in get_mesh_names(root_mesh(is_expert_parallel)):
        return False  # an expert mesh without the tp dim: expert tp of size 1
    tp_mesh = dist_index.get_submesh(tp_dim, is_expert_parallel=is_expert_parallel)
    return tp_mesh.mesh.numel() > 1
