"""Activation bytes of a forward: the tensors autograd saves for backward.

``SavedTensorCounter`` is the accounting both sides use: ``fsdp.plan`` runs a
meta-device forward under it, and ``MegatronFSDP.measure_activations()`` runs the real
forward under it on CPU. A saved tensor counts the bytes of its whole storage, each
storage once (``q``, ``k`` and ``v`` viewing one projection output count it once), and
storages of parameters and module buffers are not activations (a saved weight is a
view of the bucket the weights live in, counted as model state).

On CUDA the measurement is the allocator's: ``torch.cuda.memory_allocated`` after the
forward minus before, less the output's own storages and what the gathered buckets grew
by, and ``max_memory_allocated`` since the forward began as the step's ``peak``.

Why opt-in: with any saved-tensor hooks, autograd hands a backward a new tensor object
for a saved parameter, without its Python attributes (``weight.main_grad`` of
Megatron-Core's fused weight-gradient accumulation), so the wrapper installs no counter
unless asked. (Its own saved-weight hooks, under ``regather_saved_weights=True``, give
a custom Function's backward an alias that keeps them: ``saved_weights``; counting
composes with them.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from fsdp_hooks.runtime.backward import storage_key

__all__ = ["ActivationMeter", "SavedTensorCounter", "last_meter", "measured_forward", "measuring"]


class SavedTensorCounter:
    """Counts, while entered, the storages of the tensors autograd saves for backward,
    except those of ``exclude`` (parameters, buffers). ``inner``: saved-tensor hooks
    already in force for the same forward (``(pack, unpack)``), called after counting,
    since only the innermost hooks run."""

    def __init__(
        self,
        exclude: Iterable[torch.Tensor] = (),
        inner: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None = None,
    ) -> None:
        self.exclude = {storage_key(t) for t in exclude}
        self.seen: dict[tuple[str, int], int] = {}
        # The counted tensors, held until exit: a storage freed meanwhile (a fused
        # kernel's stand-in output on meta) could hand its identity to a new one.
        self._held: list[torch.Tensor] = []
        self._inner = inner
        self._hooks: Any = None

    @property
    def nbytes(self) -> int:
        return sum(self.seen.values())

    def add(self, *tensors: Any) -> None:
        """Count ``tensors`` as saved (what a fused kernel substituted on the meta
        device would have saved)."""
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            key = storage_key(t)
            if key not in self.exclude and key not in self.seen:
                local = t.to_local() if isinstance(t, DTensor) else t
                self.seen[key] = local.untyped_storage().nbytes()
                self._held.append(local)

    def _pack(self, t: torch.Tensor) -> Any:
        self.add(t)
        return t if self._inner is None else self._inner[0](t)

    def _unpack(self, packed: Any) -> torch.Tensor:
        return packed if self._inner is None else self._inner[1](packed)

    def __enter__(self) -> SavedTensorCounter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks, self._hooks = self._hooks, None
        self._held.clear()
        hooks.__exit__(*exc)


class ActivationMeter:
    """Measures the activations of each forward of one wrapped model (see the module
    note); ``last`` is the latest forward's bytes, ``peak`` (CUDA only) the most bytes
    allocated since that forward began, read when asked."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.last: int | None = None
        self._cuda_start: int | None = None

    def run(
        self,
        forward: Callable[[], Any],
        persistent: Iterable[torch.Tensor],
        gathered_bytes: Callable[[], int],
        inner: tuple[Callable, Callable] | None,
    ) -> Any:
        """``forward()`` measured. ``persistent``: parameters and buffers (not
        activations); ``gathered_bytes()``: the bytes of gathered buckets held now."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            gathered = gathered_bytes()
            self._cuda_start = before
            output = forward()
            grown = torch.cuda.memory_allocated(self.device) - before
            outputs = {
                storage_key(t): t.untyped_storage().nbytes()
                for t in tree_leaves(output)
                if isinstance(t, torch.Tensor) and not isinstance(t, DTensor)
            }
            self.last = max(0, grown - sum(outputs.values()) - (gathered_bytes() - gathered))
            return output
        with SavedTensorCounter(persistent, inner) as counter:
            output = forward()
        self.last = counter.nbytes
        return output

    def peak(self) -> int | None:
        if self.device.type != "cuda" or self._cuda_start is None:
            return None
        return torch.cuda.max_memory_allocated(self.device)


def measured_forward(wrapper: Any, meter: ActivationMeter, forward: Callable[[], Any]) -> Any:
    """``forward()`` of ``wrapper`` (a ``MegatronFSDP``) measured by ``meter``, inside
    the wrapper's own saved-weight hooks when they are on (composed: only the innermost
    saved-tensor hooks run)."""
    buffer = wrapper.buffer
    persistent = [
        *buffer.param_index,  # compute parameters: views of the buckets
        *wrapper.module.parameters(),
        *wrapper.module.buffers(),
    ]

    def gathered_bytes() -> int:
        total = 0
        for group in buffer.groups:
            mw = group.model_weight_buffer
            if mw is not None and mw.is_data_distributed and mw.has_unsharded_data:
                total += mw.layout.total_numel * mw.element_size
        return total

    regather = wrapper.hooks.saved_weights.saved_weights_hooks()
    if isinstance(regather, torch.autograd.graph.saved_tensors_hooks):
        inner = (regather.pack_hook, regather.unpack_hook)
        return meter.run(forward, persistent, gathered_bytes, inner)
    return meter.run(forward, persistent, gathered_bytes, None)


@contextlib.contextmanager
def measuring(state: dict[str, Any], device: torch.device) -> Iterator[None]:
    """``MegatronFSDP.measure_activations``: forwards inside are measured. The meter is
    the wrapper's ``state["_activation_meter"]`` meanwhile and, once a forward ran,
    ``state["_measured_activations"]`` after (``last_meter``)."""
    meter = state["_activation_meter"] = ActivationMeter(device)
    try:
        yield
    finally:
        state.pop("_activation_meter", None)
        if meter.last is not None:  # no forward inside: the last measurement stands
            state["_measured_activations"] = meter


def last_meter(state: dict[str, Any]) -> ActivationMeter | None:
    """The meter measuring now, else the one of the last ``measuring`` with a forward."""
    return state.get("_activation_meter") or state.get("_measured_activations")
