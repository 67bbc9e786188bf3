"""From the ranks' raw figures to the results: one aggregated row per configuration and
peer, the machine's description, and the Markdown table, JSON file and chart.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from benchmarks.compare import Config

__all__ = [
    "aggregate",
    "machine_info",
    "markdown_table",
    "plot",
    "step_times",
    "write_results",
]


def step_times(ranks: list[dict[str, Any]]) -> list[float]:
    """Per step, the slowest rank's time."""
    return [max(ts) for ts in zip(*(r["step_s"] for r in ranks), strict=True)]


def aggregate(
    configs: list[Config],
    impls: Sequence[str],
    raw: dict[tuple[str, str], list[list[dict[str, Any]]]],
    world: int,
    traced: dict[tuple[str, str], list[int]] | None = None,
) -> list[dict[str, Any]]:
    rows = []
    for cfg in configs:
        floor_runs = raw.get((cfg.workload, "floor"), [])
        floor = _median_time(floor_runs) if floor_runs else None
        stats: dict[str, dict[str, Any]] = {}
        for impl in impls:
            runs = raw.get((cfg.label, impl))
            if not runs:
                continue
            r0 = runs[0][0]
            total = sum(r0["elements"].values()) + r0["elements"]["all_reduce"]
            traffic = total * (world - 1) / world
            traced_mb = [b / 2**20 for b in (traced or {}).get((cfg.label, impl), [])]
            row = {
                "config": cfg.label,
                "workload": cfg.workload,
                "strategy": cfg.strategy,
                "no_shard_encoder": cfg.no_shard_encoder,
                "impl": impl,
                "step_ms": _median_time(runs) * 1e3,
                "floor_ms": floor * 1e3 if floor else None,
                "peak_mb": statistics.median(max(r["peak_bytes"] for r in rs) for rs in runs)
                / 2**20,
                "peak_mb_per_rep": [max(r["peak_bytes"] for r in rs) / 2**20 for rs in runs],
                "tensor_peak_mb_per_rep": traced_mb,
                "tensor_peak_mb": statistics.median(traced_mb) if traced_mb else None,
                "gathered_mb": r0["bytes"]["all_gather"] / 2**20,
                "reduced_mb": (r0["bytes"]["reduce_scatter"] + r0["bytes"]["all_reduce"]) / 2**20,
                "elements": r0["elements"],
                "calls": r0["calls"],
                "traffic_elements": traffic,
                "theory_elements": r0["theory_elements"],
                "theory_formula": r0["theory_formula"],
                "traffic_vs_theory": traffic / r0["theory_elements"]
                if r0["theory_elements"]
                else None,
                "trainable_params": r0["trainable_params"],
                "frozen_params": r0["frozen_params"],
                "model_state_bound_mb": 16 * r0["trainable_params"] / world / 2**20,
            }
            if impl.partition("@")[0] == "fsdp":
                row["expected_elements"] = r0["expected_elements"]
                row["comm_stats"] = r0["comm_stats"]
                row["trainable_buckets"] = r0["trainable_buckets"]
            stats[impl] = row
        ref = stats.get("fsdp2")
        for row in stats.values():
            row["time_vs_fsdp2"] = row["step_ms"] / ref["step_ms"] if ref else None
            row["time_vs_floor"] = row["step_ms"] / row["floor_ms"] if row["floor_ms"] else None
            row["mem_vs_fsdp2"] = (
                row["peak_mb"] / ref["peak_mb"] if ref and ref["peak_mb"] else None
            )
            row["tensor_vs_fsdp2"] = (
                row["tensor_peak_mb"] / ref["tensor_peak_mb"]
                if ref and ref["tensor_peak_mb"] and row["tensor_peak_mb"] is not None
                else None
            )
            rows.append(row)
    return rows


def _median_time(runs: list[list[dict[str, Any]]]) -> float:
    return statistics.median(t for ranks in runs for t in step_times(ranks))


def machine_info() -> dict[str, Any]:
    model = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    info: dict[str, Any] = {
        "cpu": model,
        "nproc": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()),
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


# ---- output -----------------------------------------------------------------------------
def _load(avg: Sequence[float] | None) -> str:
    return "?" if not avg else " / ".join(f"{x:.2f}" for x in avg)


def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def markdown_table(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"{result['device_type'].upper()}, world size {result['world_size']}, "
        f"{result['reps']} repetitions; {m['cpu']}, {m['nproc']} cores, torch {m['torch']}; "
        f"load average (1/5/15 min) {_load(m.get('load_average_at_start'))} at the start, "
        f"{_load(m['load_average'])} at the end ({m['date_utc']}, "
        f"{m.get('wall_s', 0.0) / 60:.1f} min).",
        "",
        "| configuration | peer | step ms | ×FSDP2 | ×floor | peak MB/rank | ×FSDP2 "
        "| peak tensor MB/rank | ×FSDP2 | gathered MB/step | reduced MB/step | traffic / theory |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['config']} | {r['impl']} | {r['step_ms']:.1f} | {_fmt(r['time_vs_fsdp2'], '.2f')} "
            f"| {_fmt(r['time_vs_floor'], '.2f')} | {r['peak_mb']:.1f} "
            f"| {_fmt(r['mem_vs_fsdp2'], '.2f')} | {_fmt(r['tensor_peak_mb'], '.2f')} "
            f"| {_fmt(r['tensor_vs_fsdp2'], '.2f')} | {r['gathered_mb']:.2f} | {r['reduced_mb']:.2f} "
            f"| {_fmt(r['traffic_vs_theory'], '.4f')} |"
        )
    floors = {}
    for r in result["rows"]:
        floors[r["workload"]] = r["floor_ms"]
    lines.append("")
    lines.append(
        "Floor (one process, per-rank batch, no wrapper), median step: "
        + ", ".join(f"{w} {_fmt(v, '.1f')} ms" for w, v in floors.items())
        + "."
    )
    lines.append("")
    lines.append(
        "Theory: per-rank ring traffic 3·Ψ·(N−1)/N elements per step for ZeRO-3 "
        "(+Ψ_frozen·(N−1)/N when a frozen encoder is sharded), 2·Ψ·(N−1)/N for ZeRO-2; "
        "Ψ = trainable parameters. Bytes are counted by wrapping the process group's "
        "collective methods in every rank."
    )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    by = {(r["config"], r["impl"]): r for r in rows}
    fig, axes = plt.subplots(3, 1, figsize=(11, 11), sharex=True)
    width = 0.8 / (len(impls) + 1)
    xs = range(len(configs))
    panels = [
        ("step time / FSDP2's", "time_vs_fsdp2", [1.0, 0.8]),
        ("peak memory / FSDP2's", "mem_vs_fsdp2", [1.0]),
        ("traffic / theory", "traffic_vs_theory", [1.0]),
    ]
    for ax, (title, key, lines) in zip(axes, panels, strict=True):
        for j, impl in enumerate(impls):
            vals = [(by.get((c, impl)) or {}).get(key) or 0.0 for c in configs]
            ax.bar([x + j * width for x in xs], vals, width, label=impl)
        if key == "time_vs_fsdp2":
            floor = [
                ((by.get((c, "fsdp2")) or {}).get("floor_ms") or 0.0)
                / ((by.get((c, "fsdp2")) or {}).get("step_ms") or 1.0)
                for c in configs
            ]
            ax.bar([x + len(impls) * width for x in xs], floor, width, label="floor")
        for y in lines:
            ax.axhline(y, color="gray", linestyle="--", linewidth=0.8)
        ax.set_ylabel(title)
        ax.legend(fontsize=8)
    axes[-1].set_xticks([x + width * len(impls) / 2 for x in xs])
    axes[-1].set_xticklabels(configs, rotation=20, ha="right", fontsize=8)
    m = result["machine"]
    fig.suptitle(
        f"fsdp vs FSDP2, {result['device_type']} world size {result['world_size']} "
        f"({m['cpu']}, torch {m['torch']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_results(result: dict[str, Any], out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out / "compare.json",
        "md": out / "compare.md",
        "png": out / "compare.png",
    }
    paths["json"].write_text(json.dumps(result, indent=1, default=str))
    paths["md"].write_text(markdown_table(result) + "\n")
    plot(result, paths["png"])
    return paths
