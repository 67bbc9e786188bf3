"""An opt-in check that every data-parallel rank runs the same collective schedule.

The hooks issue collectives (gathers, reductions) at points every rank must reach in
the same order: the root's forward, each unit's forward and backward, the end of
backward. A rank that diverges (skips a unit, runs one more forward) makes its
collectives pair with different ones on the other ranks: a hang, or silently wrong
weights when the paired buckets happen to have one size. With ``FSDP_CHECK_SCHEDULE=1``
in the environment at wrap time (or ``model.hooks.schedule = ScheduleCheck(...)``),
each of those points first all-gathers (step, phase, unit) across the data-parallel
group, and any difference raises on every rank, naming the unit, the rank and the step
where they diverged. One all-gather of three integers and a host sync per point: meant
for debugging, cheap enough to leave on while doing it.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from fsdp_buffers.collectives import wait_with_timeout

__all__ = [
    "SCHEDULE_CHECK_ENV",
    "Phase",
    "ScheduleCheck",
    "ScheduleDivergedError",
    "schedule_check_requested",
]

SCHEDULE_CHECK_ENV = "FSDP_CHECK_SCHEDULE"


def schedule_check_requested() -> bool:
    return os.environ.get(SCHEDULE_CHECK_ENV, "0").strip().lower() not in ("", "0", "false", "no")


class Phase(enum.Enum):
    FORWARD = 0  # the root's forward
    UNIT_FORWARD = 1
    UNIT_BACKWARD = 2
    END_OF_BACKWARD = 3


class ScheduleDivergedError(RuntimeError):
    """Ranks reached different points of the collective schedule."""


class ScheduleCheck:
    def __init__(
        self, group: dist.ProcessGroup, unit_names: Sequence[str], device: torch.device
    ) -> None:
        self.group = group
        self.unit_names = list(unit_names)
        self.device = device
        self.step = -1  # the root forward that starts step 0 makes it 0

    def _describe(self, step: int, phase: int, unit: int) -> str:
        where = Phase(phase).name.lower().replace("_", " ")
        if unit >= 0:
            where += f" of unit {self.unit_names[unit]!r}"
        return f"step {step}, {where}"

    def check(self, phase: Phase, unit: int = -1) -> None:
        """Agree across the group on (step, phase, unit); raise on every rank if not."""
        if phase is Phase.FORWARD:
            self.step += 1
        world = dist.get_world_size(self.group)
        mine = torch.tensor([self.step, phase.value, unit], dtype=torch.int64, device=self.device)
        everyone = torch.empty(world * 3, dtype=torch.int64, device=self.device)
        work = dist.all_gather_into_tensor(everyone, mine, group=self.group, async_op=True)
        wait_with_timeout(
            work, f"the collective-schedule check at {self._describe(*mine.tolist())}"
        )
        rows = everyone.view(world, 3).tolist()
        if all(row == rows[0] for row in rows):
            return
        ranks = dist.get_process_group_ranks(self.group)
        lines = [
            f"rank {rank}: {self._describe(*row)}" for rank, row in zip(ranks, rows, strict=True)
        ]
        first = next(i for i, row in enumerate(rows) if row != rows[0])
        raise ScheduleDivergedError(
            f"ranks diverged from the collective schedule ({SCHEDULE_CHECK_ENV}=1): rank "
            f"{ranks[first]} is at {self._describe(*rows[first])} while rank {ranks[0]} is at "
            f"{self._describe(*rows[0])}. Every rank must run the same units in the same "
            "order (a unit skipped, or a forward run, on some ranks only hangs or pairs "
            "different buckets' collectives):\n" + "\n".join(lines)
        )
