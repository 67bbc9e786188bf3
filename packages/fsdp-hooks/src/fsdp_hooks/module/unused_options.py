"""Options accepted for Megatron-FSDP / Megatron-Core compatibility that fsdp does not
act on, and the warning that says so.

Two kinds, each warned once per process: one warning per wrap names every such option
set that no earlier warning named, so wrapping twice with the same options warns once.

- CUDA-only (``CUDA_ONLY``): options that only mean something with CUDA/NCCL (NCCL user
  buffers and their registration, FP8, CUDA graphs). Accepted on every device; off CUDA
  they are ignored. On CUDA ``nccl_ub`` turns double buffering on; the others are
  no-ops there that change no result, except those also in ``IGNORED``.
- Ignored (``IGNORED``): options fsdp does not implement on any device although they
  change what Megatron-FSDP does.

Options that would change a result or a guarantee if ignored are refused instead
(``REFUSED``: a ``ValueError`` naming what to do, raised before any collective, so on
every rank).

Options left at their default are not named. ``gradient_reduce_div_fusion`` is not
named either: fsdp divides before the collective (or averages in it), which gives the
same result as Megatron-FSDP's fused NCCL pre-multiply.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from fsdp_hooks.module.config import DistributedDataParallelConfig
from fsdp_mesh.device import warn_once_each

__all__ = ["CUDA_ONLY", "IGNORED", "REFUSED", "options_set", "warn_unused_options"]

# ddp_config fields (and MegatronFSDP keywords of the same name) that need CUDA/NCCL.
CUDA_ONLY = (
    "nccl_ub",
    "disable_symmetric_registration",
    "keep_fp8_transpose_cache",
    "fp8_param_gather",
    "fp4_param_gather",
    "fsdp_manual_registration",
    "megatron_fsdp_cuda_graph_mode",
)

# Not implemented on any device: Megatron-FSDP keeps compute weights in FP8 (or FP4) and
# gathers them so, keeps .grad references for CUDA-graph replay, gathers per submodule,
# and skips the first gather of start_param_sync; Megatron-Core reduce-scatters bf16 with
# fp32 accumulation; fsdp does none of these.
IGNORED = (
    "fp8_param_gather",
    "fp4_param_gather",
    "reduce_scatter_with_fp32_accumulation",
    "megatron_fsdp_cuda_graph_mode",
    "megatron_fsdp_enable_fine_grained_param_gather",
    "fsdp_all_gather_in_start_param_sync",
    # MegatronFSDP keywords with no ddp_config field
    "enable_fine_grained_param_gather_hook",
    "enable_fine_grained_param_gather_backward_hook",
    "fine_grained_recurse_module_types",
)

# Set to anything but their default, these are refused: option -> why, and what instead.
REFUSED = {
    # Megatron-FSDP's fixed double-buffer pool is sized for the most common unit shape,
    # and a unit of another shape falls back to a persistent buffer when this is set.
    # fsdp's two slots are sized for the largest unit of each parity, so no unit ever
    # falls back and no buffer is persistent: the option would promise a memory layout
    # that does not exist here.
    "fsdp_db_use_persist_buf_on_alloc_fail": (
        "fsdp's double buffer has no allocation fallback to make persistent: its two "
        "slots are sized for the largest FSDP unit of each parity, so every unit fits "
        "(at that memory cost). Leave it False (fsdp_double_buffer alone gives fsdp's "
        "double buffering)"
    ),
}

# fully_shard's names for ddp_config fields, shown next to the field's name.
_FULLY_SHARD_NAMES = {
    "megatron_fsdp_cuda_graph_mode": "cuda_graph_mode",
    "megatron_fsdp_use_decoupled_grad": "use_decoupled_grad",
    "megatron_fsdp_enable_fine_grained_param_gather": "enable_fine_grained_param_gather",
}

_DEFAULTS = {
    f.name: f.default
    for f in dataclasses.fields(DistributedDataParallelConfig)
    if f.default is not dataclasses.MISSING
}


def options_set(ddp_config: DistributedDataParallelConfig, **keywords: Any) -> dict[str, Any]:
    """The ``CUDA_ONLY`` and ``IGNORED`` options that are set: ``ddp_config``'s fields
    away from their default, and the truthy ``keywords`` (a constructor's own copies of
    the same options). A ``REFUSED`` option that is set raises ``ValueError``."""
    for name, why in REFUSED.items():
        value = getattr(ddp_config, name, _DEFAULTS.get(name))
        if value != _DEFAULTS.get(name) or keywords.get(name):
            raise ValueError(f"{name}={keywords.get(name) or value!r} is not supported: {why}")
    keywords = {k: v for k, v in keywords.items() if k not in REFUSED}
    out: dict[str, Any] = {}
    for name in dict.fromkeys((*CUDA_ONLY, *IGNORED)):
        if name in _DEFAULTS and getattr(ddp_config, name) != _DEFAULTS[name]:
            out[name] = getattr(ddp_config, name)
        elif keywords.get(name):
            out[name] = keywords[name]
    unknown = sorted(set(keywords) - set(out) - set(CUDA_ONLY) - set(IGNORED))
    if unknown:
        raise ValueError(f"options_set: {unknown} are neither CUDA_ONLY nor IGNORED options")
    return out


def _named(names: list[str], options: Mapping[str, Any]) -> str:
    return ", ".join(
        f"{n}={options[n]!r}"
        + (f" (fully_shard's {_FULLY_SHARD_NAMES[n]})" if n in _FULLY_SHARD_NAMES else "")
        for n in names
    )


def warn_unused_options(device: torch.device, who: str, options: Mapping[str, Any]) -> None:
    """Warn once per process about the options (``options_set``) fsdp does not act on
    here: off CUDA the CUDA-only ones, on every device the ignored ones. At most one
    warning per kind per call, naming only options no earlier warning named."""
    cuda_only = [n for n in options if n in CUDA_ONLY] if device.type != "cuda" else []
    ignored = [n for n in options if n in IGNORED and n not in cuda_only]
    warn_once_each(
        [f"fsdp.cuda_only.{n}" for n in cuda_only],
        lambda new: (
            f"{who}: {_named([k.rsplit('.', 1)[1] for k in new], options)}: only "
            f"has an effect with CUDA/NCCL; ignored on {device.type}"
        ),
    )
    warn_once_each(
        [f"fsdp.ignored.{n}" for n in ignored],
        lambda new: (
            f"{who}: {_named([k.rsplit('.', 1)[1] for k in new], options)}: has no "
            "effect in fsdp (accepted for Megatron-FSDP compatibility); ignored"
        ),
    )
