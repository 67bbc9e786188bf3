"""The saved-tensor hooks that gather a released unit weight again when backward reads it.

ZeRO-3 releases a unit's weights after its forward. A gradient path into them that
bypasses the unit's outputs and runs before the unit's backward (an auxiliary loss kept
on the module, ``self.aux = f(self.fc.weight)``, backpropagated on its own) would read
freed memory. ``SavedWeightHooks`` owns what fsdp does about it: around the whole
forward (unless ``FSDP_REGATHER_SAVED_WEIGHTS=0`` at wrap) a unit weight that autograd
saves for backward is packed as a reference and unpacking it gathers its bucket if it
is released; with the override off, a gradient arriving by such a path raises on every
rank (``check_side_path``). What Python code unpacking a saved parameter gets
(``SavedParameter``) is ``saved_weights``'s.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fsdp_buffers import BucketStatus
from fsdp_hooks.runtime.saved_weights import unpacked_for_python
from fsdp_hooks.runtime.training_state import TrainingState

if TYPE_CHECKING:
    from fsdp_hooks.runtime.hooks import FSDPHooks, FSDPUnit

__all__ = ["REGATHER_ENV", "SavedWeightHooks"]

REGATHER_ENV = "FSDP_REGATHER_SAVED_WEIGHTS"


@dataclass(frozen=True, eq=False)
class _SavedWeight:
    """A unit's compute weight saved for backward, and its bucket."""

    weight: torch.Tensor
    gid: int


class SavedWeightHooks:
    """The released unit weights of one ``FSDPHooks`` and the hooks around them."""

    def __init__(self, hooks: FSDPHooks) -> None:
        self._hooks = hooks
        # id of each compute parameter a unit frees after its forward -> (bucket, unit).
        # Keyed by id for the pack hook, called for every saved tensor (a tensor's
        # __hash__ is a Python call); the parameters live as long as the wrapper.
        self._released_by_id: dict[int, tuple[int, FSDPUnit]] = {
            id(compute): (hooks.buffer.group_of(compute)[0], unit)
            for unit in hooks.units
            for _m, _a, compute, _d in unit.locations
        }
        # On unless FSDP_REGATHER_SAVED_WEIGHTS=0 (then such a path raises, see
        # check_side_path, or crashes reading freed memory first).
        self.regather_saved_weights = os.environ.get(REGATHER_ENV, "1") != "0"

    def saved_weights_hooks(self) -> contextlib.AbstractContextManager:
        """Around the whole forward (unless ``FSDP_REGATHER_SAVED_WEIGHTS=0`` at wrap): a
        unit's weight that autograd saves for backward is packed as a reference, and
        unpacking it gathers its bucket if it is released. A gradient path into the
        weights that bypasses the unit's outputs and runs before the unit's backward
        (an auxiliary loss kept on the module, ``self.aux = f(self.fc.weight)``,
        backpropagated on its own) then reads the right weights. A custom Function's
        backward gets a ``SavedParameter`` sharing the parameter's attributes
        (``saved_weights``: autograd would hand it a copy without them). With the
        override off such a path raises when its gradient arrives
        (``check_side_path``), or crashes reading freed memory first."""
        if not (self.regather_saved_weights and self._released_by_id):
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack_saved, self._unpack_saved)

    def _pack_saved(self, tensor: torch.Tensor) -> Any:
        entry = self._released_by_id.get(id(tensor))
        return tensor if entry is None else _SavedWeight(tensor, entry[0])

    def _unpack_saved(self, packed: Any) -> torch.Tensor:
        if type(packed) is not _SavedWeight:
            # Any other parameter (root buckets, other models) too: hooks in force at
            # save time cost it its attributes otherwise.
            return unpacked_for_python(packed) if type(packed) is nn.Parameter else packed
        gid = packed.gid
        hooks = self._hooks
        if hooks.buffer.buckets[gid].status is not BucketStatus.READY_TO_USE:
            # Every rank runs the same graph, so every rank gathers here; the end of
            # backward (queued now if no hook of this backward did) releases it.
            hooks._begin_backward()
            hooks.gather.gather_for_immediate_use(gid)
        return unpacked_for_python(packed.weight)

    def check_side_path(self, param: nn.Parameter) -> None:
        """A gradient for a unit's weight while the unit is not in backward (its forward
        ran, no gradient reached its outputs yet): it came through a path that bypasses
        the unit's outputs and read the weight while it was released (freed, or another
        unit's in a double-buffer slot). Every rank runs the same graph: all raise."""
        if self.regather_saved_weights:  # the default: checked first, no lookup per gradient
            return
        entry = self._released_by_id.get(id(param))
        if entry is None:
            return
        unit = entry[1]
        if unit.state is TrainingState.IDLE and unit.pending_backward > 0:
            name = self._hooks._param_names[param]
            raise RuntimeError(
                f"the gradient of {name!r} (FSDP unit {unit.name!r}) was computed by a backward "
                "that reached the weight without going through the unit's outputs (e.g. an "
                "auxiliary loss kept on the module, backpropagated on its own), while ZeRO-3 "
                "had released the unit's weights: it read freed memory. Add that loss to the "
                "main loss before one backward, or leave FSDP_REGATHER_SAVED_WEIGHTS unset "
                "(not 0) when wrapping, to gather such weights when backward reads them"
            )
