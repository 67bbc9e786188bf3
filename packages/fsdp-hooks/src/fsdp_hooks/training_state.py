"""``TrainingState``: where a wrapped model, or one of its FSDP units, is in a step."""

from __future__ import annotations

import enum

__all__ = ["TrainingState"]


class TrainingState(enum.Enum):
    """Root: IDLE outside forward and backward, FORWARD inside forward, PRE_BACKWARD
    from the first gradient reaching the model's outputs until the end of backward,
    POST_BACKWARD while the end-of-backward callback runs.

    FSDP unit: FORWARD inside its forward, PRE_BACKWARD from the first gradient
    reaching its outputs until gradients for its inputs are computed, POST_BACKWARD
    from then until the end of backward, IDLE otherwise.
    """

    FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()
    POST_BACKWARD = enum.auto()
    IDLE = enum.auto()
