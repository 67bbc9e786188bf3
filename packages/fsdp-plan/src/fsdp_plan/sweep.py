"""``--memory-per-device``: every strategy x mesh that fits, cheapest traffic first.

Candidates over ``world_size`` ranks: each ``dp_outer`` dividing it (1 is plain FSDP),
each inner strategy 0..3 replicated across the outer dim, and fully-sharded HSDP
(strategy 3, outer ``optim``) when there is an outer dim. Each is a real ``plan()``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from fsdp_plan.plan import MODEL_STATE_KEYS, Plan, plan

__all__ = ["Candidate", "parse_bytes", "sweep"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
_TRAFFIC = ("all_gather", "reduce_scatter", "all_reduce")


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"80 GB"``, ``"8e10"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?b|b)?\s*", text.lower())
    if m is None:
        raise ValueError(
            f"cannot read {text!r} as a size; write e.g. '80GiB', '80GB' or '8e10' (bytes)"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    dp_outer: int
    fits: bool
    traffic: int  # bytes each rank sends per step, all collectives

    def why_not(self, budget: int) -> str:
        per_rank = self.plan.per_rank
        parts = (*MODEL_STATE_KEYS, "gathered_peak", "activations")
        biggest = max((k for k in parts if k in per_rank), key=lambda k: per_rank[k])
        return (
            f"peak {per_rank['peak'] / 2**30:.2f} GiB > {budget / 2**30:.2f} GiB "
            f"(largest part: {biggest}, {per_rank[biggest] / 2**30:.2f} GiB)"
        )


def sweep(
    build: Callable[[], nn.Module],
    world_size: int,
    budget: int,
    ep: int = 1,
    tp: int = 1,
    **options: Any,
) -> list[Candidate]:
    """Every candidate, sorted: those that fit first, each group by bytes moved per
    step, then by peak. ``build`` makes a fresh (meta-device) model per plan (one tp
    rank's, with ``tp`` > 1). With an expert mesh (``ep`` > 1) or a tp dim, only
    ``dp_outer`` 1: the wrapper does not support hybrid sharding with either yet."""
    out = []
    # The wrapper takes hybrid sharding with neither experts nor tp yet.
    hybrid = ep == 1 and tp == 1
    outers = [d for d in range(1, world_size + 1) if world_size % d == 0] if hybrid else [1]
    for dp_outer in outers:
        configs = [(s, "no_shard") for s in (0, 1, 2, 3)]
        if dp_outer > 1:
            configs.append((3, "optim"))
        for strategy, outer in configs:
            p = plan(
                build(),
                world_size,
                dp_outer=dp_outer,
                ep=ep,
                tp=tp,
                zero_dp_strategy=strategy,
                outer_dp_sharding_strategy=outer,
                **options,
            )
            traffic = sum(p.per_rank[k] for k in _TRAFFIC)
            out.append(Candidate(p, dp_outer, p.per_rank["peak"] <= budget, traffic))
    out.sort(key=lambda c: (not c.fits, c.traffic, c.plan.per_rank["peak"]))
    return out
