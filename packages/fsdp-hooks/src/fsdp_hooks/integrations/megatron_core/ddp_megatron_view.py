"""Megatron-Core's view of the DDP adapter's buffers, for its ``DistributedOptimizer``.

Megatron-Core's ``DistributedOptimizer`` (non-FSDP path) reads the model's gradient
buffers (``model.buffers``): for each bucket, ``grad_data`` and ``param_data`` (flat
tensors), its ``offset`` in the buffer and ``numel_unpadded``; for the buffer,
``param_index_map`` (param -> (start, end, bucket_id)). It cuts every bucket into
``dp_size`` equal contiguous chunks, rank ``r`` owns chunk ``r``, and derives from
that each parameter's owned element range. Then it steps views of that range of
``param.main_grad`` / the parameter, writes the result into ``bucket.param_data`` and
asks the model to all-gather (``model.bucket_groups``,
``model._start_bucket_group_param_sync``).

fsdp's buckets are laid out differently (Note [shard layout] in ``fsdp_buffers.layout``):
a rank owns ``torch.chunk`` rows of every parameter, not a contiguous slice of the
bucket, so a bucket of fsdp's cannot be described as one of Megatron-Core's. A single
parameter can: in the parameter-major space, parameter ``i`` occupies ``N`` regions of
``width = ceil(rows / N) * row_numel`` elements back to back, and rank ``k`` owns region
``k``. So each parameter is presented as its own bucket of ``N * width`` elements
(``grad_data`` / ``param_data`` are views of fsdp's own buffers, no copy): Megatron-Core's
equal-chunk arithmetic then gives rank ``k`` exactly the rows fsdp reduce-scatters to it,
and ``offset`` / ``param_index_map`` place the buckets back to back in a virtual buffer
index space (there is no buffer-wide tensor; Megatron-Core reads none while training).

Who owns the updated weights: Megatron-Core's optimizer writes this rank's rows into the
parameters (``param_data``), not into fsdp's main-weight shard. Once it has read this view
(``buckets`` or ``param_index_map``) the adapter's parameter sync takes this rank's rows
from the parameters (copying them into the main-weight shard, exactly) before the
all-gather; ``distributed_optimizer_params()`` is refused from then on (two optimizers
would each own the weights), and this view is refused once those were handed out.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_buffers import ParamAndGradBuffer
from fsdp_buffers.bucket import Bucket

__all__ = ["MegatronBucketGroupView", "MegatronBucketView", "MegatronBufferView", "WeightsOwner"]


class WeightsOwner(enum.Enum):
    """Which optimizer writes the updated weights of a distributed-optimizer DDP."""

    UNCLAIMED = enum.auto()
    FSDP_SHARDS = enum.auto()  # distributed_optimizer_params(): fsdp's main-weight shard
    MEGATRON_DISTOPT = enum.auto()  # Megatron-Core's DistributedOptimizer: the parameters


class MegatronBucketView:
    """One parameter as one of Megatron-Core's ``_ParamAndGradBucket``s."""

    def __init__(self, bucket: Bucket, index: int, offset: int, bucket_id: int) -> None:
        self._bucket = bucket
        slot = bucket.layout.slots[index]
        self._start = bucket.layout.param_offset(index)
        self.numel = bucket.layout.shard_count * slot.width  # N equal chunks
        param = bucket.group.params[index]
        self.params_list: list[nn.Parameter] = [param]
        self.params: set[nn.Parameter] = {param}
        self.param_to_index = {param: (0, slot.numel)}
        self.offset = offset
        self.numel_unpadded = slot.numel
        self.bucket_id = bucket_id
        self.gradient_scaling_factor = 1.0  # fsdp scales before its own reduction

    @property
    def grad_data(self) -> torch.Tensor:
        """This parameter's region of the (parameter-major) gradient buffer."""
        data = self._bucket.grads.main_grads.unsharded_tensor()
        return data[self._start : self._start + self.numel]

    @property
    def param_data(self) -> torch.Tensor:
        """This parameter's region of the (parameter-major) weight buffer."""
        data = self._bucket.model.unsharded_tensor()
        return data[self._start : self._start + self.numel]


class MegatronBucketGroupView:
    """Megatron-Core's ``_ParamAndGradBucketGroup`` for one fsdp bucket: the bucket
    views of its parameters; ``model._start_bucket_group_param_sync`` gathers it."""

    def __init__(self, bucket: Bucket, buckets: list[MegatronBucketView]) -> None:
        self.fsdp_bucket = bucket
        self.buckets = buckets
        self.params = {p for b in buckets for p in b.params_list}
        self.param_to_bucket = {p: b for b in buckets for p in b.params_list}


class MegatronBufferView:
    """Megatron-Core's ``_ParamAndGradBuffer`` over fsdp's buckets of one (parameter
    dtype, gradient dtype) pair (see the module note)."""

    def __init__(
        self,
        buffer: ParamAndGradBuffer,
        bucket_ids: list[int],
        ddp_config: Any,
        data_parallel_group: dist.ProcessGroup,
        claim: Callable[[], None],
    ) -> None:
        self._claim = claim
        self.ddp_config = ddp_config
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = dist.get_world_size(data_parallel_group)
        self.num_optimizer_shards = None  # as Megatron-Core's when no layout was given
        self.gradient_scaling_factor = 1.0
        first = buffer.buckets[bucket_ids[0]]
        self.param_dtype: torch.dtype = first.model.dtype
        self.grad_dtype: torch.dtype = first.grads.main_grads.dtype
        self._buckets: list[MegatronBucketView] = []
        self.bucket_groups: list[MegatronBucketGroupView] = []
        offset = 0
        for gid in bucket_ids:
            bucket = buffer.buckets[gid]
            mine = []
            for index in range(len(bucket.group.params)):
                view = MegatronBucketView(bucket, index, offset, len(self._buckets))
                offset += view.numel
                self._buckets.append(view)
                mine.append(view)
            self.bucket_groups.append(MegatronBucketGroupView(bucket, mine))
        self.numel = offset
        self.numel_unpadded = sum(b.numel_unpadded for b in self._buckets)
        self.params: list[nn.Parameter] = [b.params_list[0] for b in self._buckets]
        self.param_indices = list(range(len(self.params)))
        self._param_index_map = {
            b.params_list[0]: (b.offset, b.offset + b.numel_unpadded, b.bucket_id)
            for b in self._buckets
        }

    @property
    def buckets(self) -> list[MegatronBucketView]:
        self._claim()
        return self._buckets

    @property
    def param_index_map(self) -> dict[nn.Parameter, tuple[int, int, int]]:
        self._claim()
        return self._param_index_map


def megatron_buffer_views(
    buffer: ParamAndGradBuffer,
    ddp_config: Any,
    data_parallel_group: dist.ProcessGroup,
    claim: Callable[[], None],
) -> list[MegatronBufferView]:
    """One view per (parameter dtype, gradient dtype) of the trainable buckets, in bucket
    order, as Megatron-Core groups its buffers."""
    by_dtypes: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for gid, bucket in enumerate(buffer.buckets):
        if not bucket.group.requires_grad or bucket.group.main_grad_buffer is None:
            continue
        key = (bucket.model.dtype, bucket.grads.main_grads.dtype)
        by_dtypes.setdefault(key, []).append(gid)
    return [
        MegatronBufferView(buffer, gids, ddp_config, data_parallel_group, claim)
        for gids in by_dtypes.values()
    ]
