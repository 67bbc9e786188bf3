"""Read the tensor-parallel attributes Megatron-Core puts on parameters.

Megatron-Core marks every parameter of its tensor-parallel layers with
``tensor_model_parallel`` (True when the tensor is split across TP ranks, False when
each TP rank holds a full copy), ``partition_dim`` and ``partition_stride``.
Megatron-FSDP's own adapter may add ``_mcore_tp``, ``_tp_partition_dim`` and
``_tp_duplicated``, which take precedence, and Megatron-Core's TE-style layers set
``_tensor_parallel_mode`` (``"column"``: split along dim 0, ``"row"``: along dim 1),
which comes first. fsdp uses these to give each parameter's
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
    """Return whether ``param`` is split across tensor-parallel ranks (Megatron-Core):
    it has a partition dim (``get_mcore_tensor_parallel_partition_dim``)."""
    return get_mcore_tensor_parallel_partition_dim(param) is not None


def is_mcore_tensor_parallel_duplicated(param: torch.Tensor) -> bool:
    """Return whether every tensor-parallel rank holds ``param`` whole: it is not split
    (Megatron-FSDP's rule: a plain parameter, with no tensor-parallel marking at all, is
    duplicated too)."""
    if getattr(param, "_tp_duplicated", False):
        return True
    return not is_mcore_tensor_model_parallel(param)


def get_mcore_tensor_parallel_partition_dim(param: torch.Tensor) -> int | None:
    """Return the dimension ``param`` is split along across TP ranks, or None if it is
    not split. Read, in order: ``_tensor_parallel_mode`` (Megatron-Core's
    ``"column"`` -> 0, ``"row"`` -> 1), ``_tp_duplicated`` (not split), then
    ``_mcore_tp``/``tensor_model_parallel`` with ``_tp_partition_dim``/``partition_dim``
    (a negative dim, Megatron-Core's ``-1``, means not split)."""
    mode = getattr(param, "_tensor_parallel_mode", None)
    if mode == "column":
        return 0
    if mode == "row":
        return 1
    if getattr(param, "_tp_duplicated", False):
        return None
    if not (getattr(param, "_mcore_tp", False) or getattr(param, "tensor_model_parallel", False)):
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
    return int(dim) if int(dim) >= 0 else None
