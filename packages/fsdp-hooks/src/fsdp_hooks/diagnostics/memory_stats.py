"""``MegatronFSDP.memory_stats()``: the model-state bytes this rank holds, measured.

Measured, not computed: each figure is the bytes of the storages the buffers (and the
optimizer's state tensors) hold now, each storage counted once, so a view shared by two
buffers (main weights that are the model weights' pieces, a hybrid gradient slice) is
not counted twice. ``fsdp.plan`` predicts the same keys from the layout alone; a test
compares the two key by key.

Keys, in bytes: ``parameters`` (model-weight buffers held between steps: the shard under
ZeRO-3, the whole parameter-major buffer below it; gathered buckets are not counted),
``main_weights`` (separate main-weight buffers: 0 when they are the model weights),
``main_grads`` (with the optimizer's copy cast to the main weights' dtype, made at the
first step, when the main grads are in another dtype; sharded gradients, which ZeRO-2/3
free at ``zero_grad`` and allocate again when a backward reduces, count at their full
size either way), ``optimizer_state`` (only when an
optimizer is given or was attached by ``fully_shard_optimizer``), ``activations`` (the
last forward run under ``model.measure_activations()``: saved tensors on CPU, the
allocator's growth on CUDA; ``fsdp_hooks.diagnostics.activations``), ``total`` (their sum) and, on
CUDA after a measured forward, ``peak`` (``max_memory_allocated`` since that forward
began).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from fsdp_hooks.diagnostics.activations import ActivationMeter

__all__ = ["measure_memory_stats"]


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    storage = t.untyped_storage()
    return str(t.device), storage.data_ptr()


class _Counter:
    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()

    def __call__(self, t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        if isinstance(t, DTensor):
            t = t.to_local()
        nbytes = t.untyped_storage().nbytes()
        if nbytes == 0:
            return 0
        key = _storage_key(t)
        if key in self.seen:
            return 0
        self.seen.add(key)
        return nbytes


def measure_memory_stats(
    buffer, optimizer: torch.optim.Optimizer | None, meter: ActivationMeter | None = None
) -> dict[str, int]:
    """The model-state bytes of ``buffer`` (a ``ParamAndGradBuffer``) and ``optimizer``,
    and the activations ``meter`` measured last (``fsdp_hooks.diagnostics.activations``)."""
    count = _Counter()
    stats = {"parameters": 0, "main_weights": 0, "main_grads": 0}
    for group in buffer.groups:
        mw = group.model_weight_buffer
        stats["parameters"] += count(mw.data if mw is not None else None)
    for gid, group in enumerate(buffer.groups):
        main = group.main_weight_buffer
        stats["main_weights"] += count(main.data if main is not None else None)
        outer = buffer.buckets[gid].outer
        fine = outer.fine_main if outer is not None else None  # may alias the weights
        stats["main_weights"] += count(fine.data if fine is not None else None)
    # Released gradients (ZeRO-2/3 between zero_grad and the next backward's reduction)
    # count as the bytes the backward allocates again; reading .data would allocate them.
    grad_bufs = [group.main_grad_buffer for group in buffer.groups]
    grad_bufs += [bucket.grads.optimizer_grad_copy for bucket in buffer.buckets]  # cast copies
    for grad in grad_bufs:
        if grad is not None and grad.is_released:
            stats["main_grads"] += grad.nbytes
        else:
            stats["main_grads"] += count(grad.data if grad is not None else None)
    if optimizer is not None:
        total = 0
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    total += count(value)
        stats["optimizer_state"] = total
    if meter is not None and meter.last is not None:
        stats["activations"] = meter.last
    stats["total"] = sum(stats.values())
    peak = meter.peak() if meter is not None else None
    if peak is not None:
        stats["peak"] = peak  # CUDA: the allocator's, since the measured forward began
    return stats
