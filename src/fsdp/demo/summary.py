"""What the demo tells a user at the end: loss, step time, memory per rank, and bytes
moved against the bound, one labelled line each.

``SUMMARY_FIELDS`` is the list of those lines: a field is a label and a function of the
run's summary (what ``run_rank`` returns on rank 0) giving its text, or None when the
run has nothing to say there (an old checkpoint's history without the figure). Adding a
figure to the summary is adding one entry.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from fsdp_buffers import ShardingStrategy

__all__ = ["SUMMARY_FIELDS", "comm_bound_bytes", "comm_bound_passes", "summary_lines"]

Summary = dict[str, Any]
Field = tuple[str, Callable[[Summary], str | None]]

LABEL_WIDTH = 12  # "checkpoint: " and the other labels line up


def comm_bound_passes(strategy: str) -> int:
    """How many times a step moves the trainable parameters' bytes, the ``3`` or ``2`` of
    the bound below."""
    return 3 if ShardingStrategy.parse(strategy).shards_model_weights else 2


def comm_bound_bytes(strategy: str, trainable_bytes: int, world_size: int) -> float:
    """Bytes a rank sends in one step with ring collectives, the bound of docs/design.md
    ("Bounds"): ``3·Ψ·(N−1)/N`` under ZeRO-3 (weights gathered in forward and again in
    backward, gradients reduce-scattered), ``2·Ψ·(N−1)/N`` below it (one weight gather
    and one gradient reduce-scatter, or one all-reduce). Ψ in bytes: the trainable
    parameters' (the communication dtype is theirs in the demo). Parameters outside every
    unit are gathered once a step under ZeRO-3, so fsdp moves less than this."""
    return comm_bound_passes(strategy) * trainable_bytes * (world_size - 1) / world_size


def _loss(s: Summary) -> str:
    first, last = s["history"][0], s["history"][-1]
    return (
        f"{first['loss']:.3f} at step {first['step']} -> {last['loss']:.3f} at step {last['step']}"
    )


def _step_time(s: Summary) -> str | None:
    # The first step of a run allocates everything; the median is what a step costs.
    times = [h["step_ms"] for h in s["history"] if "step_ms" in h]
    if not times:
        return None
    tokens = [h["tokens_per_s"] for h in s["history"] if "step_ms" in h]
    return (
        f"{statistics.median(times):.0f} ms median over {len(times)} steps "
        f"({statistics.median(tokens) / 1e3:.1f}k tokens/s over all ranks)"
    )


def _memory(s: Summary) -> str:
    last = s["history"][-1]["memory_mb"]
    peak = max(max(h["memory_mb"]) for h in s["history"])
    per_rank = "/".join(f"{m:.0f}" for m in last)
    return f"{per_rank} MB per rank at the last step ({s['memory_kind']}); at most {peak:.0f} MB"


def _bytes_moved(s: Summary) -> str | None:
    moved = [h for h in s["history"] if "comm_step_mb" in h]
    if not moved:
        return None
    last = moved[-1]
    if last["comm_bound_mb"] <= 0:
        return f"{last['comm_step_mb']:.2f} MB per rank a step (one rank: nothing to send)"
    return (
        f"{last['comm_step_mb']:.2f} MB per rank a step = {last['comm_step_mb'] / last['comm_bound_mb']:.3f}"
        f" x the bound {last['comm_bound_passes']}Ψ(N−1)/N"
        f" = {last['comm_bound_mb']:.2f} MB"
    )


def _checkpoint_blocked(s: Summary) -> str | None:
    blocked = s.get("checkpoint_blocked_s")
    if blocked is None:
        return None
    return f"blocked training {blocked:.3f} s (asynchronous; written in the background)"


SUMMARY_FIELDS: list[Field] = [
    ("loss", _loss),
    ("step time", _step_time),
    ("memory", _memory),
    ("bytes sent", _bytes_moved),
    ("saving", _checkpoint_blocked),
]


def summary_lines(summary: Summary, files: Sequence[tuple[str, object]] = ()) -> list[str]:
    """The summary's labelled lines, each field of ``SUMMARY_FIELDS`` that has something
    to say, then ``files`` (label, path): where the checkpoint, plot and metrics went."""
    lines = []
    for label, text in [*((label, fn(summary)) for label, fn in SUMMARY_FIELDS), *files]:
        if text is not None:
            lines.append(f"  {label + ':':<{LABEL_WIDTH}}{text}")
    return lines
