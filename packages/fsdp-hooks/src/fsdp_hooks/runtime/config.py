"""What the runtime is told by the front end that wraps a model: a frozen configuration
and explicit callbacks, never the wrapper itself (the runtime imports nothing above it).

``RuntimeConfig`` holds what is decided at wrap and never changes. ``RuntimeCallbacks``
holds the few questions and notices whose answers live in the front end: whether the
backward beginning now syncs (``no_sync``/``is_last_microbatch``, Megatron-FSDP's rule), the
install of main weights written in place between steps, and the end of a backward (the
wrapper counts microbatches). The front end passes weak callables, so the runtime keeps
no wrapper alive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from fsdp_mesh import FSDPDistributedIndex

__all__ = ["RuntimeCallbacks", "RuntimeConfig"]


@dataclass(frozen=True)
class RuntimeConfig:
    """Wrap-time facts the hooks act on."""

    module: nn.Module  # the wrapped module whose units are hooked
    dist_index: FSDPDistributedIndex
    overlap_grad_reduce: bool  # units mark their buckets ready at their post-backward
    regather_saved_weights: bool  # Note [released weights read later]
    # Check each gradient for NaN/Inf at first (``FSDPHooks.report_nan`` follows the
    # wrapper's attribute after that).
    report_nan: bool
    # Ranks hold different experts under the same local names (expert parallelism).
    experts_differ_across_ranks: bool


@dataclass(frozen=True)
class RuntimeCallbacks:
    """The front end's answers, asked when needed."""

    sync_grads: Callable[[], bool]  # at a backward's start: does it reduce every gradient
    install_main_weights: Callable[[], None]  # main weights written in place since
    backward_ended: Callable[[], None]  # after a backward's end (microbatch counting)
    # What the DTensor parameters point back to (``fully_shard``'s optimizer lookup).
    owner: Callable[[], object | None]
