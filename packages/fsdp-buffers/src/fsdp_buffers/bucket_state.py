"""The states and small records of a ``Bucket``: ``BucketStatus`` for its compute
weights (Note [bucket states] in ``bucket``), ``GradState`` for its gradients (Note
[gradient states] in ``bucket_grads``), which of its buffers are sharded, its process
groups and what all buckets of a buffer share."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fsdp_buffers.collectives import CommContext, CommStats
from fsdp_buffers.data_parallel_buffer import TemporaryBucketAllocator
from fsdp_buffers.mixed_precision import MixedPrecisionPolicy

__all__ = [
    "BucketContext",
    "BucketStatus",
    "CommGroup",
    "GradConfig",
    "GradStaging",
    "GradState",
    "GroupSharding",
]


class BucketStatus(enum.Enum):
    """Where a bucket's compute weights are (Note [bucket states])."""

    EMPTY = enum.auto()  # sharded: only this rank's shard exists
    # Replicated (ZeRO-1/2), left by an optimizer step: only this rank's shard of the
    # main weights is current until the next gather.
    STALE = enum.auto()
    GATHER_IN_PROGRESS = enum.auto()  # an all-gather into the unsharded bucket is in flight
    READY_TO_USE = enum.auto()  # unsharded (gathered, or replicated and current)


class GradState(enum.Enum):
    """What a bucket's main-grad storage holds (Note [gradient states])."""

    EMPTY = enum.auto()  # zeros
    ACCUMULATING = enum.auto()  # local, unreduced gradients (in the staging bucket if sharded)
    SHARD_REDUCED = enum.auto()  # reduced in the shard group; the outer reduction is to come
    REDUCED = enum.auto()  # reduced across every data-parallel rank: ready for the optimizer


class GradStaging(enum.Enum):
    """Where a backward's gradients wait for their reduction (Note [gradient staging] in
    ``bucket_grads``). Chosen at wrap time, never switched at run time."""

    AUTOGRAD = enum.auto()  # the compute parameters' ``.grad``, packed at the reduction
    MAIN_GRAD = enum.auto()  # a parameter-major staging bucket with ``param.main_grad`` views

    @classmethod
    def parse(cls, value: GradStaging | str) -> GradStaging:
        """A ``GradStaging`` or its name (``"autograd"``, ``"main_grad"``)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(
            f"grad_staging must be 'autograd' or 'main_grad' (or a GradStaging); got {value!r}"
        )


@dataclass(frozen=True)
class GradConfig:
    """How the buckets of one buffer take gradients: fixed at wrap time."""

    staging: GradStaging = GradStaging.AUTOGRAD


@dataclass(frozen=True)
class GroupSharding:
    """Which of a bucket's buffers are sharded."""

    model_weights: bool
    main_weights: bool
    grads: bool


@dataclass(frozen=True)
class CommGroup:
    """A process group resolved once: the group, its size, this rank's position."""

    group: dist.ProcessGroup | None
    size: int
    rank: int


@dataclass
class BucketContext:
    """What every bucket of one ``ParamAndGradBuffer`` shares. Mutable on purpose:
    ``reset_mixed_precision_policy`` replaces the policy of a wrapped model."""

    policy: MixedPrecisionPolicy
    stats: CommStats
    device: torch.device
    average_in_collective: bool
    scratch: TemporaryBucketAllocator
    comm: CommContext  # the streams and their order (Note [streams and frees])
    grads: GradConfig = field(default_factory=GradConfig)
    # ``policy.grad_comm_dtype_for`` of each trainable group's dtype, resolved whenever
    # the policy is set (``ParamAndGradBuffer.policy``) rather than at every reduction.
    grad_comm_dtypes: dict[torch.dtype, torch.dtype] = field(default_factory=dict)
    # Elements of whole-placed parameters each shard owns so far, per (expert, shards):
    # later buckets balance against it (Note [whole placement]).
    whole_loads: dict[tuple[bool, int], list[int]] = field(default_factory=dict)
