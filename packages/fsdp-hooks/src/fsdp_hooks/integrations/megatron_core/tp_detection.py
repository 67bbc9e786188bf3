"""Tensor-parallel modes read from module classes, as Megatron-Core's FSDP adapter does.

Megatron-Core's ``FullyShardedDataParallel`` annotates, before wrapping, every parameter
whose module class it knows with ``_tensor_parallel_mode`` (``"column"``: split along dim
0, ``"row"``: along dim 1, ``"replicated"``), which Megatron-FSDP (and
``fsdp_mesh.get_mcore_tensor_parallel_partition_dim``) reads before the older
``tensor_model_parallel`` / ``partition_dim`` attributes. The registry is keyed by class
*name*, so Transformer Engine and Megatron-Core need not be importable here; the rules
are Megatron-Core 0.19's:

- a registered class gives its mode, except that a row-parallel module's bias is
  replicated (it is added after the row reduction);
- ``TELayerNormColumnParallelLinear``: its ``layer_norm_*`` parameters are replicated,
  the rest column-parallel;
- otherwise a module's own ``tensor_model_parallel`` / ``partition_dim`` (0: column,
  1: row, biases of row modules replicated), then any class whose name contains
  ``Norm`` or ``Normalization`` (replicated), then ``TELinear``'s ``parallel_mode``;
- anything else is left unannotated (its parameter's own attributes decide).
"""

from __future__ import annotations

from torch import nn

__all__ = ["MODULE_TYPE_REGISTRY", "annotate_tensor_parallelism", "detect_parallelism_type"]

MODULE_TYPE_REGISTRY: dict[str, set[str]] = {
    "column": {
        "ColumnParallelLinear",
        "TEColumnParallelLinear",
        "TELayerNormColumnParallelLinear",
        "TEColumnParallelGroupedLinear",
        "VocabParallelEmbedding",
        "DotProductAttention",  # its attention-sink parameters
        "TEDotProductAttention",
    },
    "row": {"RowParallelLinear", "TERowParallelLinear", "TERowParallelGroupedLinear"},
    "replicated": {
        "TENorm",
        "FusedLayerNorm",
        "WrappedTorchNorm",
        "LayerNorm",
        "RMSNorm",
        "L2Norm",
        "IdentityOp",
        "TopKRouter",
    },
}


def _row(param_name: str) -> str:
    return "replicated" if "bias" in param_name else "row"


def detect_parallelism_type(
    param_name: str, module: nn.Module, registry: dict[str, set[str]] = MODULE_TYPE_REGISTRY
) -> str | None:
    """``"column"``, ``"row"`` or ``"replicated"`` for parameter ``param_name`` of
    ``module`` (its name within the module), or None when the module says nothing."""
    kind = type(module).__name__
    if kind == "TELayerNormColumnParallelLinear":
        if param_name.endswith(("layer_norm_weight", "layer_norm_bias")):
            return "replicated"
        return "column"
    for mode, names in registry.items():
        if kind in names:
            return _row(param_name) if mode == "row" else mode
    if hasattr(module, "tensor_model_parallel"):
        if not module.tensor_model_parallel:
            return "replicated"
        dim = getattr(module, "partition_dim", None)
        if dim == 0:
            return "column"
        if dim == 1:
            return _row(param_name)
    if "Norm" in kind or "Normalization" in kind:
        return "replicated"
    if kind == "TELinear":
        mode = getattr(module, "parallel_mode", None)
        if mode == "column":
            return "column"
        if mode == "row":
            return _row(param_name)
        return "replicated"
    return None


def annotate_tensor_parallelism(
    root: nn.Module, registry: dict[str, set[str]] = MODULE_TYPE_REGISTRY
) -> None:
    """Set ``_tensor_parallel_mode`` on every parameter of ``root`` whose module's
    class tells its mode (each parameter under the module that owns it)."""
    for module in root.modules():
        for name, param in module.named_parameters(recurse=False):
            mode = detect_parallelism_type(name, module, registry)
            if mode is not None:
                param._tensor_parallel_mode = mode  # type: ignore[attr-defined]
