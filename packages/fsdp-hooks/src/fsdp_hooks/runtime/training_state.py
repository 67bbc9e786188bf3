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
    from then until the end of backward, IDLE otherwise. A unit called several times in
    one forward goes through these once per call. A unit that is entirely
    ``fsdp_no_shard`` goes through them too (its hooks track the state and gather
    nothing); without trainable parameters it has no backward, so it is IDLE then.
    """

    FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()
    POST_BACKWARD = enum.auto()
    IDLE = enum.auto()
