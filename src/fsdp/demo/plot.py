"""The demo's PNG: per step, the loss, the step time, memory per rank, and the bytes a
rank sent against the bound ``3Ψ(N−1)/N`` (``2Ψ(N−1)/N`` below ZeRO-3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["PLOT_FILE", "plot_run"]

PLOT_FILE = "summary.png"


def _series(history: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """The steps that have ``key`` (a run resumed from an older checkpoint lacks the
    newer figures for its first steps) and its values there."""
    points = [(h["step"], h[key]) for h in history if key in h]
    return [s for s, _ in points], [v for _, v in points]


def plot_run(summary: dict[str, Any], path: Path) -> Path:
    """Draw ``summary["history"]`` (what ``run_rank`` returns on rank 0) into ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    from matplotlib import pyplot as plt

    history = summary["history"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex=True)
    (ax_loss, ax_time), (ax_mem, ax_comm) = axes
    fig.suptitle(
        f"fsdp-demo: {summary['strategy']} on {summary['world_size']} {summary['device']} "
        f"rank(s), {summary['parameters'] / 1e6:.2f}M parameters"
    )

    ax_loss.plot(*_series(history, "loss"), color="tab:blue")
    ax_loss.set_ylabel("loss (cross-entropy, nats/char)")

    ax_time.plot(*_series(history, "step_ms"), color="tab:orange")
    ax_time.set_ylabel("step time (ms)")

    # A run resumed at another world size has a different number of ranks per step:
    # each rank's line covers the steps it existed in.
    for rank in range(max(len(h["memory_mb"]) for h in history)):
        points = [(h["step"], h["memory_mb"][rank]) for h in history if rank < len(h["memory_mb"])]
        ax_mem.plot(*zip(*points, strict=True), label=f"rank {rank}")
    ax_mem.set_ylabel(f"memory per rank ({summary['memory_kind']}, MB)")
    ax_mem.legend(loc="best")

    ax_comm.plot(*_series(history, "comm_step_mb"), color="tab:green", label="sent (ring)")
    ax_comm.plot(
        *_series(history, "comm_bound_mb"), color="black", linestyle="--", zorder=3, label="bound"
    )
    ax_comm.set_ylabel("MB sent per rank a step")
    ax_comm.set_ylim(bottom=0)
    ax_comm.legend(loc="lower right", title="bound: 3Ψ(N−1)/N (ZeRO-3), else 2Ψ(N−1)/N")

    for ax in axes.flat:
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
