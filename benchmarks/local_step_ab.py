"""The local optimizer step against torch's own step on the DTensors, interleaved.

Each pair runs the same workload twice in fresh rank processes (``benchmarks.rank``'s
steps, as ``benchmarks.compare`` runs them): ``local``, fsdp as it is, and ``dtensor``,
with the local step bypassed (``LocalStep._kind = None``: torch's own step on the
DTensor parameters, ``foreach=None`` as given). The order within a pair alternates.
Per run, medians over the timed steps: the slowest rank's step time, rank 0's
main-thread CPU a step, and rank 0's ``LocalStep.step`` (torch's step, plus the local
step's plan in the ``local`` arm) in wall time and main-thread CPU. On a loaded machine
the CPU figures are the steadier ones (time descheduled does not count).

    uv run python -m benchmarks.local_step_ab --workload compute --strategies 3,2 --pairs 2 --steps 6
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

from benchmarks.rank import bench_rank
from benchmarks.workloads import WORKLOADS
from fsdp_hooks.optim.local_step import LocalStep


def ab_rank(
    workload: str, size: dict[str, Any], strategy: int, steps: int, warmup: int, local: bool
) -> dict[str, Any]:
    """One rank of one run: ``bench_rank``'s fsdp steps with ``LocalStep.step`` timed over
    the timed steps, and (``local`` False) the local step bypassed from the start."""
    acc: dict[str, list[Any]] = {"wall": [], "cpu": [], "local": []}
    saved_init, saved_step = LocalStep.__init__, LocalStep.step

    @functools.wraps(saved_init)
    def init(self, optimizer):
        saved_init(self, optimizer)
        if not local:
            self._kind = None

    @functools.wraps(saved_step)
    def step(self, *args, **kwargs):
        w, c = time.perf_counter(), time.thread_time()
        try:
            return saved_step(self, *args, **kwargs)
        finally:
            acc["wall"].append(time.perf_counter() - w)
            acc["cpu"].append(time.thread_time() - c)
            acc["local"].append(self.last_step_was_local)

    LocalStep.__init__, LocalStep.step = init, step
    try:
        result = bench_rank(
            "fsdp",
            workload,
            size,
            strategy,
            no_shard_encoder=False,
            steps=steps,
            warmup=warmup,
            before_timed=lambda: [v.clear() for v in acc.values()],
        )
    finally:
        LocalStep.__init__, LocalStep.step = saved_init, saved_step
    return {"step_s": result["step_s"], "cpu_s": result["cpu_s"], **acc}


def main() -> None:
    from fsdp_mesh.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="compute", choices=sorted(WORKLOADS))
    parser.add_argument("--strategies", default="3,2")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    size = WORKLOADS[args.workload].full
    env = {"OMP_NUM_THREADS": "1"}
    ms = lambda v: 1e3 * statistics.median(v)  # noqa: E731
    for strategy in map(int, args.strategies.split(",")):
        rows = []
        for pair in range(args.pairs):
            arms = (True, False) if pair % 2 == 0 else (False, True)
            got = {}
            for local in arms:
                kwargs = dict(
                    workload=args.workload,
                    size=size,
                    strategy=strategy,
                    steps=args.steps,
                    warmup=args.warmup,
                    local=local,
                )
                ranks = run_distributed(
                    ab_rank, 2, kwargs=kwargs, timeout=1200, device_type="cpu", env=env
                )
                assert all(all(x == local for x in r["local"]) for r in ranks), "arm not as asked"
                slowest = [max(s) for s in zip(*(r["step_s"] for r in ranks), strict=True)]
                got[local] = (
                    ms(slowest),
                    ms(ranks[0]["cpu_s"]),
                    ms(ranks[0]["wall"]),
                    ms(ranks[0]["cpu"]),
                )
                print(
                    f"ZeRO-{strategy} pair {pair} {'local' if local else 'dtensor'}: step "
                    f"{got[local][0]:.1f} ms wall, {got[local][1]:.1f} ms CPU; optimizer "
                    f"step {got[local][2]:.1f} ms wall, {got[local][3]:.1f} ms CPU",
                    flush=True,
                )
            rows.append(got)
        print(f"\n{args.workload} ZeRO-{strategy}, world 2 (gloo), {args.steps} timed steps a run")
        print("| pair | step wall | step CPU | opt step wall | opt step CPU |")
        print("|---|---|---|---|---|")
        for i, got in enumerate(rows):
            a, b = got[True], got[False]
            cells = [f"{x:.1f} / {y:.1f} ({x / y:.3f})" for x, y in zip(a, b, strict=True)]
            print(f"| {i} | {' | '.join(cells)} |")
        print("(each cell: local / dtensor ms (ratio))")
        print(flush=True)


if __name__ == "__main__":
    main()
