"""What a checkpoint holds besides tensors: the user's data and the RNG states.

Each rank writes ``extra/rank_<r>.pt`` (``torch.save``): the ``extra`` dict it was given
(the training step, data-loader positions, anything picklable) and its RNG states
(torch's CPU generator, every CUDA device's when CUDA is initialised, Python's
``random``, and NumPy's global one when NumPy is imported). Loading at the same world
size gives each rank its own file back; at another world size every rank gets rank 0's
(RNG streams are per rank and cannot be resharded).

DTensors are refused in ``extra`` (``dtensor_entries``): pickled per rank, a shard
would come back at another world size as rank 0's, still claiming the saving job's
mesh. Sharded state belongs in DCP (``dcp.save`` of its own, loaded into DTensors of
the loading job), or whole in ``extra`` as ``full_tensor()``.
"""

from __future__ import annotations

import io
import os
import random
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fsdp_ckpt.errors import CheckpointError, CorruptCheckpointError

__all__ = [
    "EXTRA_DIR",
    "capture_rng_state",
    "dtensor_entries",
    "extra_bytes",
    "read_extra",
    "refuse_dtensors",
    "restore_rng_state",
    "write_extra",
]

EXTRA_DIR = "extra"


def capture_rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
    numpy = sys.modules.get("numpy")
    if "numpy" in state and numpy is not None:
        numpy.random.set_state(state["numpy"])


def dtensor_entries(value: Any, where: str = "extra") -> list[str]:
    """Where ``value`` (walked through dicts, lists and tuples) holds DTensors, as
    ``extra['ema']['fc.weight']``."""
    if isinstance(value, DTensor):
        return [where]
    if isinstance(value, dict):
        items: Any = ((f"{where}[{k!r}]", v) for k, v in value.items())
    elif isinstance(value, list | tuple):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(value))
    else:
        return []
    return [found for name, v in items for found in dtensor_entries(v, name)]


def refuse_dtensors(extra: dict[str, Any] | None) -> CheckpointError | None:
    """The error naming the first DTensor in ``extra`` and what to do instead; None
    when it holds none."""
    found = dtensor_entries(extra or {})
    if not found:
        return None
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return CheckpointError(
        f"save_checkpoint: {found[0]} is a DTensor{more}: extra is pickled per rank, so "
        "at another world size every rank would get rank 0's shard, still claiming this "
        "job's mesh. Save sharded state with torch.distributed.checkpoint instead "
        "(dcp.save({'ema': ema}, checkpoint_id=another_directory), loaded with dcp.load "
        "into DTensors of the loading job, e.g. a copy of model.state_dict()), or put the "
        "whole tensor in extra (value.full_tensor(), the full size on every rank)"
    )


def _rank_file(directory: Path, rank: int) -> Path:
    return directory / EXTRA_DIR / f"rank_{rank:05d}.pt"


def extra_bytes(extra: dict[str, Any] | None) -> bytes:
    """What ``write_extra`` writes: ``extra`` and the RNG states, pickled now (an
    asynchronous save keeps the values of the call, not what training makes of them)."""
    buffer = io.BytesIO()
    torch.save({"user": dict(extra or {}), "rng": capture_rng_state()}, buffer)
    return buffer.getvalue()


def write_extra(directory: Path, rank: int, data: bytes) -> None:
    """Write ``extra_bytes``' output as this rank's extra state file, synced."""
    path = _rank_file(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_extra(directory: Path, rank: int, same_world: bool) -> dict[str, Any]:
    """The saved ``{"user": ..., "rng": ...}`` for ``rank`` (see the module note).
    Checkpoints are trusted input: the file is unpickled."""
    path = _rank_file(directory, rank if same_world else 0)
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a damaged pickle raises anything
        raise CorruptCheckpointError(f"cannot read the extra state {path}: {exc!r}") from exc
    if not isinstance(saved, dict) or not {"user", "rng"} <= saved.keys():
        raise CorruptCheckpointError(
            f"{path} does not hold fsdp's extra state (a dict with 'user' and 'rng')"
        )
    return saved
