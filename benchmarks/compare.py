"""fsdp against PyTorch FSDP2 (and Megatron-FSDP on CUDA), side by side in one run.

    uv run python -m benchmarks.compare            # CPU: gloo, 2 ranks, 1 thread each
    uv run python -m benchmarks.compare --help

For every workload, strategy and variant it runs, in alternating repetitions, the same
model (same seed, same per-rank batch, same world size) under:

- ``fsdp``: this library's ``fully_shard`` with the workload's FSDP units;
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on each unit module, then the root
  (``reshard_after_forward=True`` for ZeRO-3, ``False``, its ZeRO-2 analogue, for ZeRO-2;
  parameters that ``fsdp_no_shard`` keeps replicated are FSDP2's ``ignored_params``);
- ``megatron_fsdp``: NVIDIA's ``megatron_fsdp.fully_shard`` (CUDA only, when the ``bench``
  dependency group is installed: ``uv sync --group bench``);
- ``floor``: the model in one process, no wrapper, on the per-rank batch: the compute
  floor a data-parallel rank cannot beat.

Every run is a fresh set of rank processes (``fsdp_mesh.testing.run_distributed``). Each
rank reports, over the timed steps (after the warm-up steps):

- step time (forward, backward, optimizer step, zero_grad), as the slowest rank's;
- peak memory: on CPU the peak RSS (``VmHWM``, reset after wrapping) minus the RSS taken
  right after the unwrapped model was built; on CUDA ``max_memory_allocated`` minus the
  allocated bytes at the same point;
- on CPU also the peak of live tensor bytes over the built model's (CUDA's
  ``max_memory_allocated`` analogue, from torch's CPU allocator as the profiler records
  it), in as many extra traced repetitions as timed ones (median);
- elements all-gathered, reduce-scattered and all-reduced per step (unsharded sizes),
  counted by wrapping the process group's collective methods inside the rank (the same
  counter for every peer), and for ``fsdp`` also its own ``model.comm_stats()``.

Communication is compared with DESIGN.md's bound ``3·Ψ·(N−1)/N`` elements per step and
rank for ZeRO-3 (Ψ trainable parameters; frozen parameters that are sharded add
``Ψ_frozen·(N−1)/N``, one gather in forward) and ``2·Ψ·(N−1)/N`` for ZeRO-2 (one gather
of the updated weights, one reduce-scatter). ``fsdp``'s count is also checked exactly
against what its buckets imply (:func:`benchmarks.measure.expected_fsdp_elements`).

Results: ``benchmarks/results/compare.{json,md,png}``.

This module is the driver and the command line; the workloads and their models are in
``benchmarks/workloads.py``, what a rank measures in ``benchmarks/measure.py``, one rank's
repetition in ``benchmarks/rank.py``, and aggregation and output in ``benchmarks/report.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.rank import bench_rank
from benchmarks.report import aggregate, machine_info, markdown_table, step_times, write_results
from benchmarks.workloads import WORKLOADS, vars_of
from fsdp_mesh.testing import run_distributed

__all__ = ["Config", "main", "run_benchmark"]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Config:
    workload: str
    strategy: int  # 3 (ZeRO-3) or 2 (ZeRO-2)
    no_shard_encoder: bool = False

    @property
    def label(self) -> str:
        variant = "+no_shard" if self.no_shard_encoder else ""
        return f"{self.workload}{variant} ZeRO-{self.strategy}"


def _configs(workloads: Sequence[str], strategies: Sequence[int]) -> list[Config]:
    out = []
    for w in workloads:
        for s in strategies:
            out.append(Config(w, s))
            if w == "frozen":
                out.append(Config(w, s, no_shard_encoder=True))
    return out


def _megatron_available() -> bool:
    try:
        import megatron_fsdp  # noqa: F401
    except ImportError:
        return False
    return True


def run_benchmark(
    workloads: Sequence[str] = ("overhead", "blocks", "compute", "frozen"),
    strategies: Sequence[int] = (3, 2),
    reps: int = 3,
    tiny: bool = False,
    world_size: int | None = None,
    device_type: str | None = None,
    impls: Sequence[str] | None = None,
    profile_dir: str | None = None,
    timeout: float = 600.0,
    log: Callable[[str], None] = print,
    sizes: dict[str, dict[str, Any]] | None = None,
    floor: bool = True,
) -> dict[str, Any]:
    """Run every configuration ``reps`` times, alternating peers, and aggregate.
    ``sizes`` overrides a workload's model sizes (by workload name); ``floor=False``
    skips the one-process floor."""
    cuda = device_type == "cuda" or (device_type is None and torch.cuda.is_available())
    device_type = "cuda" if cuda else "cpu"
    if world_size is None:
        world_size = torch.cuda.device_count() if cuda else 2
    if impls is None:
        impls = ["fsdp", "fsdp2"]
        if cuda and _megatron_available():
            impls.append("megatron_fsdp")
    configs = _configs(workloads, strategies)
    load_at_start = list(os.getloadavg())
    started = time.perf_counter()
    raw: dict[tuple[str, str], list[list[dict[str, Any]]]] = {}
    traced: dict[tuple[str, str], list[int]] = {}
    env = {"OMP_NUM_THREADS": "1"}
    run_vars = {w: vars_of(WORKLOADS[w], tiny, (sizes or {}).get(w)) for w in workloads}

    def run_ranks(
        cfg: Config | None, workload: str, impl: str, **options: Any
    ) -> list[dict[str, Any]]:
        """One repetition of ``impl`` (``floor``: one process) on fresh rank processes."""
        used = run_vars[workload]
        kwargs = {
            "impl": impl,
            "workload": workload,
            "size": used["size"],
            "strategy": cfg.strategy if cfg else 3,
            "no_shard_encoder": cfg.no_shard_encoder if cfg else False,
            "steps": used["steps"],
            "warmup": used["warmup"],
            **options,
        }
        world = 1 if impl == "floor" else world_size
        return run_distributed(
            bench_rank, world, kwargs=kwargs, timeout=timeout, device_type=device_type, env=env
        )

    for rep in range(reps):
        for workload in workloads:
            # The floor: one process, one rank's batch, no wrapper.
            runs: list[tuple[Config | None, str]] = [(None, "floor")] if floor else []
            for cfg in (c for c in configs if c.workload == workload):
                order = list(impls[rep % len(impls) :]) + list(impls[: rep % len(impls)])
                for impl in order:
                    if impl == "megatron_fsdp" and cfg.no_shard_encoder:
                        continue
                    runs.append((cfg, impl))
            if rep % 2:
                runs.reverse()
            for cfg, impl in runs:
                t0 = time.perf_counter()
                ranks = run_ranks(
                    cfg, workload, impl, profile_dir=profile_dir if rep == 0 else None
                )
                label = cfg.label if cfg else f"{workload} floor"
                med = statistics.median(step_times(ranks))
                log(
                    f"rep {rep + 1}/{reps} {label:<28} {impl:<14} median step "
                    f"{med * 1e3:9.2f} ms  ({time.perf_counter() - t0:.1f} s)"
                )
                raw.setdefault((label if cfg else workload, impl), []).append(ranks)
    if device_type == "cpu":
        # Live tensor bytes, CUDA's max_memory_allocated analogue: traced repetitions
        # (benchmarks.measure.TensorTrace), after the timed ones, as many; the median.
        for cfg in (c for _ in range(reps) for c in configs):
            for impl in impls:
                if impl == "megatron_fsdp":
                    continue
                ranks = run_ranks(cfg, cfg.workload, impl, steps=0, trace_tensors=True)
                peak = max(r["tensor_peak_bytes"] for r in ranks)
                log(f"traced {cfg.label:<28} {impl:<14} peak tensors {peak / 2**20:9.2f} MB")
                traced.setdefault((cfg.label, impl), []).append(peak)
    rows = aggregate(configs, impls, raw, world_size, traced)
    machine = machine_info()
    machine["load_average_at_start"] = load_at_start
    machine["wall_s"] = time.perf_counter() - started
    return {
        "machine": machine,
        "device_type": device_type,
        "world_size": world_size,
        "reps": reps,
        "tiny": tiny,
        "impls": list(impls),
        "workloads": run_vars,
        "rows": rows,
        "raw": {f"{k[0]}|{k[1]}": v for k, v in raw.items()},
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compare", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--workloads", default="overhead,blocks,compute,frozen", help="comma-separated subset"
    )
    parser.add_argument("--strategies", default="3,2", help="ZeRO stages to run: 3, 2 or both")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per configuration")
    parser.add_argument("--tiny", action="store_true", help="tiny models, 2 steps (smoke test)")
    parser.add_argument("--world-size", type=int, default=None, help="default: GPUs, or 2 on CPU")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--impls", default=None, help="comma-separated peers (default: all)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile every rank's timed steps in the first repetition (slows it down)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    for w in workloads:
        if w not in WORKLOADS:
            parser.error(f"unknown workload {w!r}; choose from {sorted(WORKLOADS)}")
    profile_dir = None
    if args.profile:
        profile_dir = str(args.out / "profiles")
        Path(profile_dir).mkdir(parents=True, exist_ok=True)
    result = run_benchmark(
        workloads,
        [int(s) for s in args.strategies.split(",")],
        reps=args.reps,
        tiny=args.tiny,
        world_size=args.world_size,
        device_type=args.device,
        impls=args.impls.split(",") if args.impls else None,
        profile_dir=profile_dir,
    )
    paths = write_results(result, args.out)
    print()
    print(markdown_table(result))
    print()
    for kind, path in paths.items():
        print(f"{kind}: {path}")


if __name__ == "__main__":
    main()
