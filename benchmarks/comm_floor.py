"""The communication floor of a workload: its step's collectives alone, no compute, no
wrapper (issue "host overhead": what bounds a target that stays out of reach).

For each workload and strategy it builds the model, takes one bucket per FSDP unit (the
unit's parameter elements, padded to the world size) and one for the parameters outside
every unit (the root), and runs one step's collectives back to back in fp32, each
asynchronous with one in flight before it is waited on (a one-deep pipeline, as a
prefetching wrapper has):

- ZeRO-3: root and units all-gathered in forward order, units all-gathered again in
  reverse and reduce-scattered in reverse, then the root reduce-scattered (the root is
  gathered once and held all step, as both wrappers do: 3·Ψ_units + 2·Ψ_root elements
  before the (N−1)/N);
- ZeRO-2: units and root reduce-scattered in reverse, then all updated shards
  all-gathered (2·Ψ·(N−1)/N elements).

On a machine whose cores the ranks' compute already fills (2 cores, 2 ranks), the
transport cannot overlap compute, so ``floor + communication`` (the one-process compute
floor of ``benchmarks.compare`` plus this) is a lower bound of any wrapper's step there.

    uv run python -m benchmarks.comm_floor [--workloads blocks,compute] [--strategies 3,2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.workloads import WORKLOADS, build_model, unit_classes
from fsdp_mesh.testing import run_distributed

__all__ = ["bucket_sizes", "main"]


def bucket_sizes(workload: str) -> tuple[int, list[int]]:
    """(root elements, elements of each unit in forward order) of a workload's model:
    units are the outermost modules of its unit classes; the root holds the rest."""
    model = build_model(workload, WORKLOADS[workload].full)
    classes = tuple(unit_classes(workload))
    units: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if isinstance(module, classes) and not any(id(p) in inside for p in module.parameters()):
            units.append(module)
            inside.update(id(p) for p in module.parameters())
    unit_sizes = [sum(p.numel() for p in u.parameters() if p.requires_grad) for u in units]
    root = sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in inside)
    return root, [n for n in unit_sizes if n]


def _schedule(strategy: int, root: int, units: list[int]) -> list[tuple[str, int]]:
    order = ([root] if root else []) + units
    if strategy == 3:
        back = list(reversed(units))
        return (
            [("gather", n) for n in order]
            + [op for n in back for op in (("gather", n), ("reduce", n))]
            + ([("reduce", root)] if root else [])
        )
    if strategy == 2:
        return [("reduce", n) for n in reversed(order)] + [("gather", n) for n in order]
    raise ValueError(f"strategy must be 2 or 3; got {strategy}")


def _rank(schedule: list[tuple[str, int]], steps: int, warmup: int) -> list[float]:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    pad = {n: -(-n // world) * world for _op, n in schedule}
    bufs = {n: (torch.randn(n // world), torch.randn(n)) for n in set(pad.values())}
    times = []
    for step in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        pending = None
        for op, n in schedule:
            shard, full = bufs[pad[n]]
            if op == "gather":
                work = dist.all_gather_into_tensor(full, shard, async_op=True)
            else:
                work = dist.reduce_scatter_tensor(shard, full, async_op=True)
            if pending is not None:
                pending.wait()
            pending = work
        if pending is not None:
            pending.wait()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="overhead,blocks,compute")
    parser.add_argument("--strategies", default="3,2")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    print("| workload | strategy | buckets | elements/step/rank sent | communication ms/step |")
    print("|---|---|---:|---:|---:|")
    for workload in args.workloads.split(","):
        root, units = bucket_sizes(workload)
        for strategy in (int(s) for s in args.strategies.split(",")):
            schedule = _schedule(strategy, root, units)
            per_rank = run_distributed(
                _rank, args.world_size, args=(schedule, args.steps, 2), timeout=600
            )
            slowest = [max(ts) for ts in zip(*per_rank, strict=True)]
            world = args.world_size
            sent = sum(n * (world - 1) // world for _op, n in schedule)
            print(
                f"| {workload} | ZeRO-{strategy} | {len(units) + bool(root)} | {sent:,} | "
                f"{1e3 * statistics.median(slowest):.1f} |"
            )


if __name__ == "__main__":
    main()
