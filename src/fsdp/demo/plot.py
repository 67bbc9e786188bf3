"""The demo's PNG: loss per step, and memory per rank per step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["PLOT_FILE", "plot_run"]

PLOT_FILE = "loss_memory.png"


def plot_run(summary: dict[str, Any], path: Path) -> Path:
    """Draw ``summary["history"]`` (what ``run_rank`` returns on rank 0) into ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    from matplotlib import pyplot as plt

    history = summary["history"]
    steps = [h["step"] for h in history]
    fig, (ax_loss, ax_mem) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    ax_loss.plot(steps, [h["loss"] for h in history], color="tab:blue")
    ax_loss.set_ylabel("loss (cross-entropy, nats/char)")
    ax_loss.set_title(
        f"fsdp-demo: {summary['strategy']} on {summary['world_size']} {summary['device']} "
        f"rank(s), {summary['parameters'] / 1e6:.2f}M parameters"
    )
    ax_loss.grid(alpha=0.3)
    # A run resumed at another world size has a different number of ranks per step:
    # each rank's line covers the steps it existed in.
    for rank in range(max(len(h["memory_mb"]) for h in history)):
        points = [(h["step"], h["memory_mb"][rank]) for h in history if rank < len(h["memory_mb"])]
        ax_mem.plot(*zip(*points, strict=True), label=f"rank {rank}")
    ax_mem.set_ylabel(f"memory ({summary['memory_kind']}, MB)")
    ax_mem.set_xlabel("step")
    ax_mem.legend(loc="best")
    ax_mem.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
