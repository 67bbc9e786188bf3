"""``FSDPUnit``: one FSDP unit module and its per-step state; its ``UnitGroup`` (Note
[unit groups]) gathers, releases and reduces its buckets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fsdp_hooks.runtime.training_state import TrainingState

__all__ = ["FSDPUnit"]


@dataclass(eq=False)
class FSDPUnit:
    index: int
    name: str
    module: nn.Module
    groups: list[int]  # buckets to gather for this unit, tied ones included
    release_groups: list[int]  # of those, the ones this unit releases (not root buckets)
    state: TrainingState = TrainingState.IDLE
    # Whether it has gathering hooks (its ``UnitGroup``'s); not if entirely fsdp_no_shard.
    hooked: bool = False
    handles: list[Any] = field(default_factory=list)
    # (module, attr, compute, distributed) of the parameters whose gathered bucket this
    # unit releases: swapped to the DTensor shard while released (see the module note).
    locations: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = field(default_factory=list)
    # ``locations`` by module: (module, {attr: compute}, {attr: DTensor}).
    swaps: list[tuple[nn.Module, dict, dict]] = field(default_factory=list)
