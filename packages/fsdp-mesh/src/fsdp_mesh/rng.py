"""A named RNG-state tracker, like Megatron's CudaRNGStatesTracker, for CPU and CUDA.

Tensor-parallel regions (dropout inside a TP-split layer, TP-split weight init) must
draw different random numbers on each TP rank, while everything else must draw the
same numbers on every data-parallel replica. The tracker keeps extra generator states
by name; ``fork(name)`` swaps one into the device's default generator for the duration
of a block, then saves its advanced state and puts the default state back, so the
default stream continues exactly as if the block had not drawn anything.

States are read with ``Generator.get_state()`` and written with ``set_state()`` on the
device's default generator: one copy each way. ``torch.cuda.set_rng_state`` would add
a clone of its own, which Megatron found costly at scale.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from fsdp_mesh.device import default_device_type, warn_once

__all__ = [
    "EXPERT_PARALLEL_RNG_TRACKER_NAME",
    "MODEL_PARALLEL_RNG_TRACKER_NAME",
    "RNGStatesTracker",
    "get_cuda_rng_tracker",
    "get_rng_tracker",
    "initialize_rng_tracker",
    "model_parallel_seed",
]

logger = logging.getLogger(__name__)

MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
# Seed offsets of Megatron-Core's model_parallel_cuda_manual_seed, so that a model
# seeded through fsdp draws the same numbers as under Megatron-Core.
_TP_SEED_OFFSET = 2718
_EXPERT_SEED_OFFSET = 1024


def _default_generator(device_type: str) -> torch.Generator:
    """The default generator of ``device_type`` that ops on the current device draw from."""
    if device_type == "cpu":
        return torch.default_generator
    if device_type == "cuda":
        torch.cuda.init()  # default_generators is empty until CUDA is initialised
        return torch.cuda.default_generators[torch.cuda.current_device()]
    raise ValueError(
        f"The RNG tracker supports device types 'cpu' and 'cuda'; got {device_type!r}."
    )


class RNGStatesTracker:
    """Named generator states for one device type, swapped in by :meth:`fork`.

    ``use_cudagraphable_rng`` (CUDA only) keeps each state as a generator registered
    in graph-safe form, so forks can be captured in CUDA graphs; elsewhere it is
    ignored with a warning. An inference tracker (``is_inference_rng_tracker``)
    ignores ``add``/``set_states`` and forks to a no-op, as in Megatron.
    """

    def __init__(
        self,
        device_type: str | None = None,
        use_cudagraphable_rng: bool = False,
        is_inference_rng_tracker: bool = False,
    ) -> None:
        self.device_type = device_type or default_device_type()
        if self.device_type not in ("cpu", "cuda"):
            raise ValueError(
                f"The RNG tracker supports device types 'cpu' and 'cuda'; got {self.device_type!r}."
            )
        if use_cudagraphable_rng and self.device_type != "cuda":
            warn_once(
                "rng.use_cudagraphable_rng",
                "use_cudagraphable_rng only applies to CUDA generators; ignored on "
                f"{self.device_type!r}.",
            )
            use_cudagraphable_rng = False
        self.use_cudagraphable_rng = use_cudagraphable_rng
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self.reset()

    def reset(self) -> None:
        """Forget every tracked state."""
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor | torch.Generator] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        """Whether a state was added or set since the last reset."""
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor | torch.Generator]:
        """Return the states by name (a new dict holding the tracker's own state objects)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor | torch.Generator]) -> None:
        """Replace the tracked states (e.g. from a checkpoint); the dict is taken as is."""
        if self.is_inference_rng_tracker:
            return
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Track a new state ``name`` seeded with ``seed``; the default generator is untouched."""
        if self.is_inference_rng_tracker:
            return
        if seed in self.seeds_:
            raise ValueError(f"RNG tracker: seed {seed} is already used by another state.")
        if name in self.states_:
            raise ValueError(
                f"RNG tracker: a state named {name!r} already exists; tracked states are "
                f"{sorted(self.states_)}."
            )
        self._is_initialized = True
        self.seeds_.add(seed)
        default = _default_generator(self.device_type)
        if self.use_cudagraphable_rng:
            state = default.clone_state()
            state.manual_seed(seed)
            self.states_[name] = state
        else:
            # A fresh generator of the same kind gives a state in the same format.
            self.states_[name] = (
                torch.Generator(device=default.device).manual_seed(seed).get_state()
            )

    def _get(self, gen: torch.Generator) -> torch.Tensor | torch.Generator:
        return gen.graphsafe_get_state() if self.use_cudagraphable_rng else gen.get_state()

    def _set(self, gen: torch.Generator, state: torch.Tensor | torch.Generator) -> None:
        if self.use_cudagraphable_rng:
            gen.graphsafe_set_state(state)
        else:
            gen.set_state(state)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Draw from state ``name`` inside the block; restore the default state after it."""
        if self.is_inference_rng_tracker:
            yield
            return
        if name not in self.states_:
            raise KeyError(
                f"RNG tracker: no state named {name!r}; add it first with add(name, seed). "
                f"Tracked states are {sorted(self.states_)}."
            )
        gen = _default_generator(self.device_type)
        orig_state = self._get(gen)
        self._set(gen, self.states_[name])
        # Drawing CPU numbers inside a CUDA fork is usually a bug: it is not forked.
        cpu_state = torch.get_rng_state() if self.device_type == "cuda" else None
        try:
            yield
        finally:
            if cpu_state is not None and not torch.equal(cpu_state, torch.get_rng_state()):
                logger.warning("CPU RNG state changed within a CUDA RNG tracker fork.")
            self.states_[name] = self._get(gen)
            self._set(gen, orig_state)


_RNG_TRACKER: RNGStatesTracker | None = None


def initialize_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    force_reset: bool = False,
    device_type: str | None = None,
) -> None:
    """Create the process-wide tracker, unless one exists and ``force_reset`` is False.

    Keyword arguments are Megatron-FSDP's. Transformer Engine's tracker
    (``use_te_rng_tracker``) is not supported: a warning is given once and this
    tracker is used. ``device_type`` defaults to CUDA when available, else CPU.
    """
    global _RNG_TRACKER
    if force_reset:
        _RNG_TRACKER = None
    if _RNG_TRACKER is not None:
        return
    if use_te_rng_tracker:
        warn_once(
            "rng.use_te_rng_tracker",
            "use_te_rng_tracker=True: Transformer Engine's RNG tracker is not supported "
            "by fsdp; using fsdp's RNGStatesTracker instead.",
        )
    _RNG_TRACKER = RNGStatesTracker(
        device_type,
        use_cudagraphable_rng=use_cudagraphable_rng,
        is_inference_rng_tracker=inference_rng_tracker,
    )


def get_cuda_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
) -> RNGStatesTracker:
    """Return the process-wide tracker, creating it on first use (Megatron's name)."""
    initialize_rng_tracker(use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    assert _RNG_TRACKER is not None
    return _RNG_TRACKER


def get_rng_tracker() -> RNGStatesTracker:
    """Return the process-wide tracker (device-agnostic alias of get_cuda_rng_tracker)."""
    return get_cuda_rng_tracker()


def model_parallel_seed(
    seed: int,
    tp_rank: int = 0,
    *,
    ep_rank: int | None = None,
    expt_tp_rank: int = 0,
) -> RNGStatesTracker:
    """Seed for tensor parallelism, as Megatron-Core's ``model_parallel_cuda_manual_seed``.

    The tracker device's default generator gets ``seed`` (the same on every rank, so
    data-parallel replicas stay in step); the tracker is reset and gets
    ``"model-parallel-rng"`` = ``seed + 2718 + tp_rank`` (different per TP rank, the
    same across DP ranks) and, when ``ep_rank`` is given, ``"expert-parallel-rng"`` =
    ``seed + 1024 + 100 * ep_rank + expt_tp_rank``. Returns the tracker.
    """
    if tp_rank < 0 or (ep_rank is not None and ep_rank < 0) or expt_tp_rank < 0:
        raise ValueError(
            f"model_parallel_seed: ranks must be non-negative; got tp_rank={tp_rank}, "
            f"ep_rank={ep_rank}, expt_tp_rank={expt_tp_rank}."
        )
    tracker = get_cuda_rng_tracker()
    _default_generator(tracker.device_type).manual_seed(seed)
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _TP_SEED_OFFSET + tp_rank)
    if ep_rank is not None:
        tracker.add(
            EXPERT_PARALLEL_RNG_TRACKER_NAME,
            seed + _EXPERT_SEED_OFFSET + 100 * ep_rank + expt_tp_rank,
        )
    return tracker
