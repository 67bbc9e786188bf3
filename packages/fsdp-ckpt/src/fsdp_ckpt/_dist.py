"""Collectives that degrade to no-ops without a process group, so that every function
of this package also runs in one plain process."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

__all__ = [
    "agree",
    "all_gather_object",
    "barrier",
    "broadcast_object",
    "first_error",
    "is_distributed",
    "quiet_single_process",
    "rank",
    "world_size",
]


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """``obj`` of rank ``src`` on every rank (of ``group``, default: every rank; ``src``
    is a global rank)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj``, in rank order (of ``group``, default: every rank)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def agree(
    error: BaseException | None, group: dist.ProcessGroup | None = None
) -> BaseException | None:
    """Every rank's local verdict, combined: the error of the lowest rank that found
    one (its message prefixed with that rank when there are several ranks), else None.
    Raising the result raises on every rank together, so one rank's bad news never
    leaves the others waiting in a collective."""
    if not is_distributed():
        return error
    return first_error(all_gather_object(error, group))


def first_error(verdicts: list[BaseException | None]) -> BaseException | None:
    """The error of the lowest rank among every rank's ``verdicts`` (gathered), its
    message prefixed with that rank when there are several ranks; else None."""
    for r, verdict in enumerate(verdicts):
        if verdict is not None:
            if len(verdicts) > 1 and verdict.args and isinstance(verdict.args[0], str):
                verdict.args = (f"[rank {r}] {verdict.args[0]}", *verdict.args[1:])
            return verdict
    return None


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process, which is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
