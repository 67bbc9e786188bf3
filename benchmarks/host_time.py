"""Host time per unit from ``benchmarks.compare --profile`` output (issue "host overhead",
target 4).

From each cProfile dump (``OUT/profiles/<workload>-zero<k>-<impl>-rank<r>.prof``), own
time summed over every function, split three ways:

- compute: torch's C++ operators (``torch._C`` methods, ``torch.*`` and
  ``torch._C._nn.*`` built-ins) and the autograd engine's own time (``run_backward``);
- collectives: the c10d built-ins (``torch._C._distributed_c10d.*``: calls and ``wait``);
- host: everything else (Python of fsdp/FSDP2, DTensor, torch.optim, nn.Module calls,
  autograd hooks, the benchmark's collective counters).

Host time per step (steps = calls of ``run_backward``) divided by the workload's units.
cProfile inflates Python time, for every peer alike: compare peers of one run.

    uv run python -m benchmarks.host_time OUT/profiles [--top 15] [--package fsdp_]

Without a profiler (``--cpu OUT/compare.json`` of a run without ``--profile``): each rank's
main-thread CPU time per timed step (``cpu_s``, ``time.thread_time``), median over steps
and repetitions, minus the one-process floor's, divided by the units. With
``OMP_NUM_THREADS=1`` torch's kernels run on that thread, so this counts everything a
wrapper adds on the host thread: its Python and its own copies, but neither gloo's
transfers (its threads) nor time spent waiting or descheduled, which the profile's wall
clock does count. No profiler overhead either, which grows with the number of calls.

    uv run python -m benchmarks.host_time --cpu OUT/compare.json [OUT2/compare.json ...]

With several sets, a last table gives each peer's ratio in every set, their median and
their maximum.
"""

from __future__ import annotations

import argparse
import json
import pstats
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks.workloads import WORKLOADS

_NAME = re.compile(r"(?P<workload>[a-z]+)-zero(?P<strategy>\d)-(?P<impl>.+)-rank(?P<rank>\d+)$")
_COLLECTIVE = "torch._C._distributed_c10d."


def kind_of(func: tuple[str, int, str]) -> str:
    """``compute``, ``collective`` or ``host`` for one pstats key."""
    filename, _line, name = func
    if filename != "~":
        return "host"
    if _COLLECTIVE in name:
        return "collective"
    if "run_backward" in name:
        return "compute"
    if "torch._C." in name or name.startswith("<built-in method torch."):
        return "compute"
    return "host"


@dataclass(frozen=True)
class HostTime:
    steps: int
    units: int
    total: float
    compute: float
    collective: float
    host: float

    @property
    def host_per_unit_ms(self) -> float:
        return 1e3 * self.host / self.steps / self.units


def host_time(path: Path, units: int) -> HostTime:
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    sums = {"compute": 0.0, "collective": 0.0, "host": 0.0}
    steps = 0
    for func, (_cc, nc, tt, _ct, _callers) in stats.items():
        sums[kind_of(func)] += tt
        if func[0] == "~" and "run_backward" in func[2]:
            steps += nc
    if steps == 0:
        raise ValueError(f"{path}: no run_backward call, so no step to divide by")
    return HostTime(steps, units, sum(sums.values()), **sums)


def top_own(path: Path, count: int, package: str | None) -> list[tuple[float, int, str]]:
    """The ``count`` entries with the most own time (only files under ``package``)."""
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    rows = []
    for (filename, line, name), (_cc, nc, tt, _ct, _callers) in stats.items():
        if package is not None and package not in filename:
            continue
        short = "/".join(filename.split("/")[-2:]) if filename != "~" else ""
        rows.append((tt, nc, f"{short}:{line} {name}" if short else name))
    return sorted(rows, reverse=True)[:count]


def median_cpu(reps: list[list[dict]]) -> dict[int, float]:
    """Rank -> median main-thread CPU seconds per timed step over every repetition."""
    per_rank: dict[int, list[float]] = {}
    for ranks in reps:
        for r in ranks:
            if "cpu_s" not in r:
                raise ValueError("no cpu_s in these results: rerun benchmarks.compare")
            per_rank.setdefault(r.get("rank", 0), []).extend(r["cpu_s"])
    return {rank: statistics.median(v) for rank, v in sorted(per_rank.items())}


@dataclass(frozen=True)
class HostCpu:
    """One peer's row of ``host_cpu_rows``: CPU seconds a step per rank, the floor's, the
    excess a unit per rank, and that excess over FSDP2's per rank (empty without FSDP2)."""

    cpu: dict[int, float]
    floor: float
    per_unit: dict[int, float]
    ratio: list[float]


def host_cpu_rows(result: dict) -> dict[tuple[str, str], HostCpu]:
    """(configuration, peer) -> its main-thread CPU against the floor and FSDP2, for every
    workload of a ``benchmarks.compare`` result (its compare.json) that has units."""
    raw = result["raw"]
    rows: dict[tuple[str, str], HostCpu] = {}
    for key in sorted(raw):
        label, impl = key.split("|")
        workload = label.split()[0].split("+")[0]  # "frozen+no_shard ZeRO-3"
        units = result["workloads"][workload]["size"].get("n_units")
        floor_key, ref_key = f"{workload}|floor", f"{label}|fsdp2"
        if impl == "floor" or units is None or floor_key not in raw:
            continue
        floor = median_cpu(raw[floor_key])[0]
        cpu = median_cpu(raw[key])
        ref = median_cpu(raw[ref_key]) if ref_key in raw else {}
        per_unit = {r: (v - floor) / units for r, v in cpu.items()}
        ratio = [per_unit[r] / ((ref[r] - floor) / units) for r in cpu if r in ref]
        rows[(label, impl)] = HostCpu(cpu, floor, per_unit, ratio)
    return rows


def host_cpu_table(result: dict) -> list[str]:
    """Markdown rows from a ``benchmarks.compare`` result (its compare.json): main-thread
    CPU per step, and its excess over the floor per unit, against FSDP2's."""
    lines = [
        "| workload | peer | CPU ms/step (rank 0 / 1) | floor ms/step | host CPU ms/unit | "
        "×FSDP2 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for (label, impl), row in host_cpu_rows(result).items():
        lines.append(
            f"| {label} | {impl} | {' / '.join(f'{v * 1e3:.1f}' for v in row.cpu.values())} "
            f"| {row.floor * 1e3:.1f} "
            f"| {' / '.join(f'{v * 1e3:.3f}' for v in row.per_unit.values())} "
            f"| {' / '.join(f'{v:.2f}' for v in row.ratio)} |"
        )
    return lines


def host_cpu_summary(results: list[dict]) -> list[str]:
    """Markdown rows over several sets of runs (one compare.json each): each peer's host
    CPU ×FSDP2 in every set (its worst rank), their median and their maximum, so that a
    target is judged on more than one set (one set's ratio moves by a few hundredths)."""
    per_set = [host_cpu_rows(result) for result in results]
    keys = sorted({key for rows in per_set for key in rows})
    lines = [
        "| workload | peer | ×FSDP2 in each set (worst rank) | median | max |",
        "|---|---|---|---:|---:|",
    ]
    for label, impl in keys:
        found = (rows.get((label, impl)) for rows in per_set)
        worst = [max(row.ratio) for row in found if row is not None and row.ratio]
        if not worst:
            continue
        lines.append(
            f"| {label} | {impl} | {' / '.join(f'{v:.2f}' for v in worst)} "
            f"| {statistics.median(worst):.2f} | {max(worst):.2f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profiles", type=Path, nargs="?", help="folder of .prof files")
    parser.add_argument("--top", type=int, default=0, help="also list the top own-time entries")
    parser.add_argument("--package", default=None, help="with --top: only files under this")
    parser.add_argument(
        "--cpu",
        type=Path,
        nargs="+",
        default=None,
        help="compare.json (one or more sets of runs): main-thread CPU, no profiler",
    )
    args = parser.parse_args()
    if args.cpu is not None:
        results = [json.loads(path.read_text()) for path in args.cpu]
        for path, result in zip(args.cpu, results, strict=True):
            if len(results) > 1:
                print(f"\n{path}:")
            print("\n".join(host_cpu_table(result)))
        if len(results) > 1:
            print(f"\nOver the {len(results)} sets:")
            print("\n".join(host_cpu_summary(results)))
        return
    if args.profiles is None:
        parser.error("give a profiles folder, or --cpu compare.json")
    rows: dict[tuple[str, str], dict[str, dict[int, HostTime]]] = {}
    for path in sorted(args.profiles.glob("*.prof")):
        m = _NAME.match(path.stem)
        if m is None:
            continue
        units = WORKLOADS[m["workload"]].full.get("n_units")
        if units is None:
            continue
        key = (m["workload"], m["strategy"])
        ht = host_time(path, units)
        rows.setdefault(key, {}).setdefault(m["impl"], {})[int(m["rank"])] = ht
        if args.top:
            print(f"\n{path.name}: {ht.steps} steps, top own time (s, calls)")
            for tt, nc, what in top_own(path, args.top, args.package):
                print(f"  {tt:7.3f} {nc:7d}  {what}")
    print(
        "\n| workload | peer | ms host/unit/step (rank 0 / 1) | ×FSDP2 | host / collective / "
        "compute s (rank 0) |"
    )
    print("|---|---|---:|---:|---:|")
    for (workload, strategy), impls in sorted(rows.items()):
        ref = impls.get("fsdp2", {})
        for impl, ranks in sorted(impls.items()):
            per = [ranks[r].host_per_unit_ms for r in sorted(ranks)]
            ratio = [
                ranks[r].host_per_unit_ms / ref[r].host_per_unit_ms
                for r in sorted(ranks)
                if r in ref
            ]
            r0 = ranks[min(ranks)]
            print(
                f"| {workload} ZeRO-{strategy} | {impl} | {' / '.join(f'{v:.2f}' for v in per)} "
                f"| {' / '.join(f'{v:.2f}' for v in ratio)} "
                f"| {r0.host:.2f} / {r0.collective:.2f} / {r0.compute:.2f} |"
            )


if __name__ == "__main__":
    main()
