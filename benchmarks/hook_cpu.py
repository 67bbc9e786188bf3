"""Main-thread CPU per fsdp hook and per bucket operation, without a profiler.

``host_time --cpu`` says how much main-thread CPU fsdp adds to a step; this says where.
Each method named in ``TIMED`` is wrapped, on its class, before the model is wrapped
(the hooks bind their methods at wrap time), with a pair of ``time.thread_time()``
calls; the timed steps' calls and CPU are summed per method. With ``OMP_NUM_THREADS=1``
torch's kernels run on the main thread, so a method's figure counts its Python, the
kernels it launches (copies, the gloo input clone) and the kernel time of waking from a
wait, but not time spent blocked or descheduled, which cProfile's wall clock counts on
two shared cores. Each timer costs about a microsecond, which every call's figure
includes; the figures are inclusive (a hook's time contains the methods it calls). The
steps are ``benchmarks.rank``'s, as ``benchmarks.compare`` runs them (its collective
counter included), so the step CPU matches ``host_time --cpu``'s plus the timers.

    uv run python -m benchmarks.hook_cpu --workload blocks --strategy 3 --steps 100

A name in ``TIMED`` that no longer exists raises (a renamed method must not silently
drop out of the table).
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from benchmarks.host_time import median_cpu
from benchmarks.rank import bench_rank
from benchmarks.workloads import WORKLOADS

# "module:Class.method", outermost first within each group.
TIMED: tuple[str, ...] = (
    "fsdp_hooks.runtime.hooks:FSDPHooks.root_pre_forward",
    "fsdp_hooks.runtime.hooks:FSDPHooks._unit_pre_forward",
    "fsdp_hooks.runtime.hooks:FSDPHooks._unit_post_forward",
    "fsdp_hooks.runtime.hooks:FSDPHooks.root_post_forward",
    "fsdp_hooks.runtime.hooks:FSDPHooks._group_pre_backward",
    "fsdp_hooks.runtime.hooks:FSDPHooks._on_param_grad",
    "fsdp_hooks.runtime.unit_group:UnitGroup.post_backward",
    "fsdp_hooks.runtime.hooks:FSDPHooks._end_of_backward",
    "fsdp_buffers.all_gather_pipeline:AllGatherPipeline.all_gather_params",
    "fsdp_buffers.all_gather_pipeline:AllGatherPipeline._prefetch",
    "fsdp_buffers.all_gather_pipeline:AllGatherPipeline.release_bucket",
    "fsdp_buffers.bucket:Bucket.start_gather",
    "fsdp_buffers.bucket:Bucket.wait_gather",
    "fsdp_buffers.grad_reduce_pipeline:GradReducePipeline.accumulate",
    "fsdp_buffers.grad_reduce_pipeline:GradReducePipeline.mark_bucket_ready",
    "fsdp_buffers.bucket_grads:BucketGradients.accumulate",
    "fsdp_buffers.bucket_grads:BucketGradients.start_reduce",
    "fsdp_buffers.collectives:PendingCollective.wait",
    "fsdp_hooks.runtime.param_swap:ParamSwapping.unit_use",
    "fsdp_hooks.optim.local_step:LocalStep.step",
)


def _resolve(name: str) -> tuple[type, str]:
    module, _, qual = name.partition(":")
    cls_name, _, method = qual.partition(".")
    cls = getattr(importlib.import_module(module), cls_name, None)
    if cls is None or not callable(cls.__dict__.get(method)):
        raise AttributeError(
            f"benchmarks.hook_cpu.TIMED names {name!r}, which does not exist (renamed?): "
            "update TIMED so that the table keeps covering it"
        )
    return cls, method


@contextmanager
def timed_methods(names: Sequence[str]) -> Iterator[dict[str, list[float]]]:
    """Wrap each named method with a CPU timer for the duration; yields
    ``{name: [calls, cpu_seconds]}`` (clear it to restart the count)."""
    acc: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    saved: list[tuple[type, str, Any]] = []
    clock = time.thread_time
    try:
        for name in names:
            cls, method = _resolve(name)
            original = cls.__dict__[method]
            short = name.partition(":")[2]

            def make(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
                @functools.wraps(fn)
                def timer(*args: Any, **kwargs: Any) -> Any:
                    start = clock()
                    try:
                        return fn(*args, **kwargs)
                    finally:
                        entry = acc[key]
                        entry[0] += 1
                        entry[1] += clock() - start

                return timer

            saved.append((cls, method, original))
            setattr(cls, method, make(original, short))
        yield acc
    finally:
        for cls, method, original in reversed(saved):
            setattr(cls, method, original)


def hook_cpu_rank(
    workload: str, size: dict[str, Any], strategy: int, steps: int, warmup: int, wrap: bool
) -> dict[str, Any]:
    """One rank of ``benchmarks.rank.bench_rank`` (fsdp with ``wrap``, else the floor)
    with the ``TIMED`` methods counted over its timed steps only; returns their step CPU
    (``cpu_s``) and, wrapped, the methods' calls and CPU seconds."""
    with timed_methods(TIMED if wrap else ()) as acc:
        result = bench_rank(
            "fsdp" if wrap else "floor",
            workload,
            size,
            strategy,
            no_shard_encoder=False,
            steps=steps,
            warmup=warmup,
            before_timed=acc.clear,
        )
        methods = {k: tuple(v) for k, v in acc.items()}
        return {"rank": result["rank"], "cpu_s": result["cpu_s"], "methods": methods}


def table(
    size: dict[str, Any], steps: int, wrapped: list[dict[str, Any]], floor: dict[str, Any]
) -> str:
    """Markdown: the step's CPU against the floor, then each timed method (rank 0)."""
    floor_ms = 1e3 * median_cpu([[floor]])[0]
    step_ms = [1e3 * v for v in median_cpu([wrapped]).values()]
    units = size.get("n_units")
    excess = step_ms[0] - floor_ms
    lines = [
        f"step CPU ms (ranks): {' / '.join(f'{v:.1f}' for v in step_ms)}; floor {floor_ms:.1f}; "
        f"excess (rank 0) {excess:.1f} ms" + (f", {excess / units:.3f} ms a unit" if units else ""),
        "",
        "| method (inclusive) | calls/step | us/call | ms/step | share of excess |",
        "|---|---:|---:|---:|---:|",
    ]
    methods = wrapped[0]["methods"]
    for name in (n.partition(":")[2] for n in TIMED):
        if name not in methods:
            continue
        calls, cpu = methods[name]
        per_step = 1e3 * cpu / steps
        share = f"{per_step / excess:.0%}" if excess > 0 else "n/a"
        lines.append(
            f"| {name} | {calls / steps:.1f} | {1e6 * cpu / calls:.1f} | {per_step:.2f} | {share} |"
        )
    return "\n".join(lines)


def main() -> None:
    from fsdp_mesh.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="blocks", choices=sorted(WORKLOADS))
    parser.add_argument("--strategy", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--tiny", action="store_true", help="the workload's tiny sizes")
    args = parser.parse_args()
    wl = WORKLOADS[args.workload]
    size = wl.tiny if args.tiny else wl.full
    env = {"OMP_NUM_THREADS": "1"}

    def run(world: int, wrap: bool) -> list[dict[str, Any]]:
        kwargs = {
            "workload": args.workload,
            "size": size,
            "strategy": args.strategy,
            "steps": args.steps,
            "warmup": wl.warmup,
            "wrap": wrap,
        }
        return run_distributed(
            hook_cpu_rank, world, kwargs=kwargs, timeout=900, device_type="cpu", env=env
        )

    floor = run(1, wrap=False)[0]
    wrapped = run(2, wrap=True)
    print(f"{args.workload} ZeRO-{args.strategy}, {args.steps} timed steps, world size 2 (gloo)")
    print(table(size, args.steps, wrapped, floor))


if __name__ == "__main__":
    main()
