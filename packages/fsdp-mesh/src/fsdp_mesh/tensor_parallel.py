"""Read the tensor-parallel attributes Megatron-Core puts on parameters.

Megatron-Core marks every parameter of its tensor-parallel layers with
``tensor_model_parallel`` (True when the tensor is split across TP ranks, False when
each TP rank holds a full copy), ``partition_dim`` and ``partition_stride``.
Megatron-FSDP's own adapter may add ``_mcore_tp``, ``_tp_partition_dim`` and
``_tp_duplicated``, which take precedence. fsdp uses these to give each parameter's
DTensor the right placement on the TP mesh dimension: ``Shard(partition_dim)`` for a
TP-split parameter, ``Replicate()`` for a duplicated one.
"""

from __future__ import annotations

import torch

__all__ = [
    "get_mcore_tensor_parallel_partition_dim",
    "is_mcore_tensor_model_parallel",
    "is_mcore_tensor_parallel_duplicated",
]


def is_mcore_tensor_model_parallel(param: torch.Tensor) -> bool:
    """Return whether ``param`` is split across tensor-parallel ranks (Megatron-Core)."""
    return bool(
        getattr(param, "_mcore_tp", False) or getattr(param, "tensor_model_parallel", False)
    )


def is_mcore_tensor_parallel_duplicated(param: torch.Tensor) -> bool:
    """Return whether ``param`` belongs to a TP model but is duplicated on every TP rank.

    True when ``_tp_duplicated`` is set, or when Megatron-Core tagged the parameter
    explicitly with ``tensor_model_parallel=False`` (its default for non-split weights
    such as layer norms, which every TP rank holds whole). A parameter with neither
    attribute comes from a model that knows nothing of TP and is not "duplicated".
    """
    if getattr(param, "_tp_duplicated", False):
        return True
    if is_mcore_tensor_model_parallel(param):
        return False
    return hasattr(param, "tensor_model_parallel") and not param.tensor_model_parallel


def get_mcore_tensor_parallel_partition_dim(param: torch.Tensor) -> int | None:
    """Return the dimension ``param`` is split along across TP ranks, or None if it is not split."""
    if not is_mcore_tensor_model_parallel(param):
        return None
    dim = getattr(param, "_tp_partition_dim", None)
    if dim is None:
        dim = getattr(param, "partition_dim", None)
    if dim is None:
        raise ValueError(
            f"Parameter of shape {tuple(param.shape)} is marked tensor-model-parallel but has "
            "no 'partition_dim' (or '_tp_partition_dim') attribute; set it to the dimension "
            "the tensor is split along across tensor-parallel ranks."
        )
    return int(dim)
