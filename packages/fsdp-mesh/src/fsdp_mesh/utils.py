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
    than one rank."""
    tp_dim = dist_index.tp_dim
    if tp_dim is None:
        return False
    mesh = dist_index.get_root_mesh(is_expert_parallel)
    if tp_dim not in get_mesh_names(mesh):
        return False  # an expert mesh without the tp dim: expert tp of size 1
    return dist_index.get_submesh(tp_dim, is_expert_parallel=is_expert_parallel).size() > 1
