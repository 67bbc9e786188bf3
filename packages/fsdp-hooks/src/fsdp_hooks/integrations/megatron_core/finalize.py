"""``finalize_model_grads``: Megatron-Core's last step before ``optimizer.step()``.

It finishes the gradient reduction of every model chunk and, for a per-token loss,
divides the gradients by the number of tokens in the global batch. Megatron-Core's
other syncs have nothing to do here: expert gradients are reduced over the expert
data-parallel group by ``finish_grad_sync`` itself; tensor-parallel parameters need no
extra reduction (parameters that would, Megatron's ``sequence_parallel`` and
``average_gradients_across_tp_domain`` ones, are refused at wrap time, see Note [tensor
parallelism] in ``fsdp_buffers.tensor_parallel``); and embeddings tied across pipeline
stages do not exist, as pipeline parallelism is not implemented.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["finalize_model_grads"]


def _dp_group(chunk: nn.Module) -> dist.ProcessGroup:
    index = getattr(chunk, "dist_index", None)
    if index is None:
        raise TypeError(
            f"finalize_model_grads: {type(chunk).__name__} is not an fsdp model (no "
            "dist_index); pass models built by DistributedDataParallel, "
            "FullyShardedDataParallel or fully_shard"
        )
    return index.get_dp_group()


def finalize_model_grads(
    model: Sequence[nn.Module] | nn.Module,
    num_tokens: torch.Tensor | None = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
) -> None:
    """Finish gradient sync of every chunk of ``model`` (a list of model chunks, or one
    model). With ``num_tokens`` (this rank's token count, a tensor), the counts are
    summed over the data-parallel group and every gradient is divided by the total,
    as with ``config.calculate_per_token_loss``. Megatron-Core's signature:
    ``pg_collection`` is accepted (the chunks carry their own groups) and
    ``force_all_reduce`` is passed to every chunk's ``finish_grad_sync``."""
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    if not chunks:
        raise ValueError("finalize_model_grads: got no model chunks")
    for chunk in chunks:
        if not callable(getattr(chunk, "finish_grad_sync", None)):
            raise TypeError(
                f"finalize_model_grads: {type(chunk).__name__} has no finish_grad_sync(); "
                "pass models built by DistributedDataParallel, FullyShardedDataParallel "
                "or fully_shard"
            )
        chunk.finish_grad_sync(force_all_reduce=force_all_reduce)
    if num_tokens is None:
        return
    if not isinstance(num_tokens, torch.Tensor):
        raise TypeError(
            f"finalize_model_grads: num_tokens must be a tensor (this rank's token count); "
            f"got {type(num_tokens).__name__}"
        )
    total = num_tokens.detach().clone()
    dist.all_reduce(total, group=_dp_group(chunks[0]))
    tokens = total.item()  # one device-to-host read
    if tokens > 0:
        for chunk in chunks:
            chunk.scale_gradients(1.0 / tokens)
