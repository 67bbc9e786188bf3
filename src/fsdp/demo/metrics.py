"""What the progress bar and the plot show: memory per rank and bytes communicated."""

from __future__ import annotations

import os
import resource
import sys

import torch

__all__ = ["comm_bytes", "memory_bytes", "memory_kind"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def memory_kind(device: torch.device) -> str:
    return "max allocated" if device.type == "cuda" else "RSS"


def memory_bytes(device: torch.device) -> int:
    """CUDA: the most memory tensors have held on this rank's GPU. CPU: this process's
    resident set size (its peak where the current size cannot be read)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


def comm_bytes(stats: dict[str, dict[str, float]]) -> float:
    """Bytes this rank sent, over every kind of collective (ring algorithm), from
    ``model.comm_stats()``."""
    return float(sum(kind["traffic_bytes"] for kind in stats.values()))
