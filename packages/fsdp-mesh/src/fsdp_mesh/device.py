"""Device and backend helpers shared by every layer.

fsdp runs the same code path on CPU (gloo) and CUDA (NCCL); these helpers are the only
place that decides which one is in use (``default_device_type`` when nothing says,
``current_device`` for a mesh's device type), so the rest of the code never tests for
CUDA itself.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "backend_for_device",
    "control_device",
    "current_device",
    "default_device_type",
    "warn_once",
    "warn_once_each",
]

# Device type -> the collective backend fsdp uses for it.
_BACKENDS: dict[str, str] = {"cuda": "nccl", "cpu": "gloo"}

_warned_keys: set[str] = set()
_warned_lock = threading.Lock()


def default_device_type() -> str:
    """Return the device type fsdp computes and communicates on when none is given:
    ``"cuda"`` when a CUDA device is usable and the default process group, if there is
    one, talks NCCL (a gloo group on a CUDA machine communicates CPU tensors); else
    ``"cpu"``. Every default mesh, tracker and device is built from this answer."""
    if not torch.cuda.is_available():
        return "cpu"
    if dist.is_available() and dist.is_initialized():
        return "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    return "cuda"


def backend_for_device(device_type: str) -> str:
    """Return the process-group backend for ``device_type``: ``"nccl"`` or ``"gloo"``."""
    try:
        return _BACKENDS[device_type]
    except KeyError:
        raise ValueError(
            f"No collective backend is known for device type {device_type!r}; "
            f"supported device types are {sorted(_BACKENDS)}."
        ) from None


def current_device(device_type: str | None = None) -> torch.device:
    """Return the device this process computes on for ``device_type``.

    For CUDA this is the current device (``torch.cuda.set_device`` picks it), with its
    index, so tensors created on it land on this rank's GPU.
    """
    device_type = device_type or default_device_type()
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "current_device('cuda') was asked for, but CUDA is not available in this "
                "process; use device_type='cpu' (gloo) instead."
            )
        return torch.device("cuda", torch.cuda.current_device())
    if device_type == "cpu":
        return torch.device("cpu")
    raise ValueError(
        f"Unsupported device type {device_type!r}; supported device types are {sorted(_BACKENDS)}."
    )


def control_device(device: torch.device) -> torch.device:
    """Return where a small control tensor (a flag or a count that a collective
    agrees on) lives for buffers on ``device``: ``device`` itself, or this process's
    default device when the buffers are on the meta device (a plan, or a model not yet
    materialized), since collectives cannot move meta tensors."""
    return current_device() if device.type == "meta" else device


def warn_once(key: str, message: str, category: type[Warning] = UserWarning) -> bool:
    """Emit ``message`` the first time ``key`` is seen in this process; return whether it did.

    Used for options that only mean something on CUDA/NCCL: they are accepted
    everywhere, and a CPU run says once (not once per call) that they were ignored.
    """
    with _warned_lock:
        if key in _warned_keys:
            return False
        _warned_keys.add(key)
    warnings.warn(message, category, stacklevel=2)
    return True


def warn_once_each(
    keys: Sequence[str],
    message: Callable[[list[str]], str],
    category: type[Warning] = UserWarning,
) -> list[str]:
    """One warning, ``message(new)``, for those of ``keys`` not seen before in this
    process (none when all were); return them.

    For a group of options set together: one warning names them all, and a later call
    with the same options says nothing, one with a new option names only that one.
    """
    with _warned_lock:
        new = [k for k in dict.fromkeys(keys) if k not in _warned_keys]
        _warned_keys.update(new)
    if new:
        warnings.warn(message(new), category, stacklevel=2)
    return new
