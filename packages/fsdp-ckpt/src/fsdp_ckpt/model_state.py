"""Sharded model state dicts: what DCP saves and loads in place."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from fsdp_ckpt.names import entry_of, param_by_state_key
from fsdp_ckpt.row_shards import add_row_offsets, strip_row_offsets

__all__ = ["get_model_state_dict", "install_compute_weights", "set_model_state_dict"]


def get_model_state_dict(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` ready for DCP: each value is the live tensor (sharded
    DTensors hold this rank's shard, with uneven row shards given their true offsets;
    see ``row_shards``), so ``dcp.load`` into it writes straight into the model's
    storage. No communication for fsdp models and plain modules; one small
    ``all_gather_object`` when another library's DTensors could be uneven."""
    sd = model.state_dict()
    params = param_by_state_key(model, sd.keys())
    return add_row_offsets({k: entry_of(v, params.get(k)) for k, v in sd.items()})


def install_compute_weights(model: nn.Module) -> None:
    """Refresh compute weights from main weights where the model keeps both (fsdp's
    ``install_optimized_model_weights``, found by duck typing). A collective for
    strategies that all-gather it."""
    install = getattr(model, "install_optimized_model_weights", None)
    if callable(install):
        install()


def set_model_state_dict(
    model: nn.Module, state_dict: Mapping[str, Any], strict: bool = True
) -> Any:
    """``model.load_state_dict(state_dict)`` for a state dict from
    ``get_model_state_dict`` (or any with the same keys and placements), then
    ``install_compute_weights``. Returns what ``load_state_dict`` returns."""
    result = model.load_state_dict(strip_row_offsets(dict(state_dict)), strict=strict)
    install_compute_weights(model)
    return result
