"""The unit summary logged once on rank 0 at wrap time."""

from __future__ import annotations

import logging
from typing import Protocol

import torch.distributed as dist

from fsdp_buffers import ParamAndGradBuffer

logger = logging.getLogger("fsdp_hooks")

__all__ = ["log_unit_summary", "unit_summary"]


class _Wrapper(Protocol):
    """What the summary reads of a ``MegatronFSDP``."""

    buffer: ParamAndGradBuffer
    strategy: object


def unit_summary(wrapper: _Wrapper) -> list[dict[str, object]]:
    """One row per FSDP unit (and one for parameters outside units): parameter count,
    bytes in the compute dtype, and whether it is sharded or ``no_shard``. Coalesced
    units (``suggested_communication_unit_size``) are one row, under the first's name."""
    buffer = wrapper.buffer
    rows: list[dict[str, object]] = []
    names = [*buffer.unit_names, None]
    for unit_id, name in enumerate(names):
        gids = buffer.groups_of_unit(unit_id if name is not None else None)
        if not gids:
            continue
        params = sum(buffer.groups[g].numel for g in gids)
        nbytes = sum(
            buffer.groups[g].numel * buffer.groups[g].params[0].element_size() for g in gids
        )
        no_shard = all(buffer.groups[g].fsdp_no_shard for g in gids)
        sharded = any(buffer.buckets[g].sharding.model_weights for g in gids)
        mode = "no_shard" if no_shard else ("sharded" if sharded else "replicated")
        joined = len(buffer.groups[gids[0]].coalesced_unit_ids) - 1
        if name is not None and joined > 0:  # unit coalescing: the group's first unit
            name = f"{name} (+{joined} coalesced unit(s))"
        rows.append(
            {
                "unit": name if name is not None else "(outside units)",
                "params": params,
                "bytes": nbytes,
                "mode": mode,
                "buckets": len(gids),
            }
        )
    return rows


def log_unit_summary(wrapper: _Wrapper) -> None:
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    rows = unit_summary(wrapper)
    lines = [
        f"  {r['unit']}: {r['params']:,} params, {r['bytes']:,} bytes, {r['mode']}, "
        f"{r['buckets']} bucket(s)"
        for r in rows
    ]
    logger.info(
        "fsdp: %d FSDP unit(s), strategy %s\n%s",
        len(wrapper.buffer.unit_names),
        wrapper.strategy.megatron_name,
        "\n".join(lines),
    )
