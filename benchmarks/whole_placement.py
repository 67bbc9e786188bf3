"""Bytes per step of whole placement (Muon on the GPT blocks' matrices, AdamW for the
rest) against the row placement (AdamW for everything), from ``model.comm_stats()``'s
ring traffic per rank, and the share of padding in the bytes moved (``padding_bytes``,
Note [whole placement]).

Run ``uv run python -m benchmarks.whole_placement [--tiny]`` (CPU, gloo); results in
docs/benchmarks.md. Byte counts do not depend on the device.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from benchmarks.workloads import WORKLOADS, build_model, loss_of, make_batch, unit_classes
from fsdp_mesh.testing import run_distributed

WORKLOAD = "compute"


def _optimizers(module: torch.nn.Module, mode: str):
    if mode == "row":
        return torch.optim.AdamW(module.parameters(), lr=1e-4)
    named = list(module.named_parameters())
    hidden = [p for n, p in named if p.ndim == 2 and n.startswith("blocks.")]
    rest = [p for n, p in named if not (p.ndim == 2 and n.startswith("blocks."))]
    return [torch.optim.Muon(hidden, lr=1e-4), torch.optim.AdamW(rest, lr=1e-4)]


def measure(
    mode: str, strategy: int, tiny: bool, unit_size: int | None = None
) -> tuple[float, float, float, float]:
    """For ``mode`` ("row": AdamW everywhere; "whole": Muon on the blocks' matrices,
    placed whole, AdamW for the rest): ring bytes each rank sends in one step, the padding
    share of them, the largest rank's peak memory over the model's (bytes; CPU: RSS),
    and the median step time (ms) of the slowest rank. ``unit_size``: unit coalescing
    (``suggested_communication_unit_size``), which lets the owners of one bucket balance
    over several blocks' matrices. One placement per process group, so that the peak of
    one does not hide the other's."""
    import time

    from benchmarks.measure import MemoryProbe
    from fsdp_hooks import fully_shard

    size = WORKLOADS[WORKLOAD].tiny if tiny else WORKLOADS[WORKLOAD].full
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build_model(WORKLOAD, size)
    probe = MemoryProbe(torch.device("cpu"))
    model, opts = fully_shard(
        module,
        _optimizers(module, mode),
        fsdp_unit_modules=unit_classes(WORKLOAD),
        zero_dp_strategy=strategy,
        suggested_communication_unit_size=unit_size,
    )
    opts = opts if isinstance(opts, list) else [opts]
    probe.reset_peak()
    times = []
    for step in range(4):  # bytes from the second step, times from the second on
        model.reset_comm_stats()
        dist.barrier()
        start = time.perf_counter()
        x, y = make_batch(WORKLOAD, size, step, rank, world, torch.device("cpu"))
        loss_of(WORKLOAD, model(*x), y).backward()
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad()
        times.append(time.perf_counter() - start)
        if step == 1:
            stats = list(model.comm_stats().values())
    traffic = sum(c["traffic_bytes"] for c in stats)
    padding = sum(c["padding_bytes"] for c in stats) / sum(c["bytes"] for c in stats)
    worst = torch.tensor([float(probe.peak_increase()), 1e3 * sorted(times[1:])[1]])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return traffic, padding, float(worst[0]), float(worst[1])


def main() -> None:
    tiny = "--tiny" in sys.argv
    # --unit-size N (elements): unit coalescing for both placements.
    unit_size = None
    if "--unit-size" in sys.argv:
        unit_size = int(sys.argv[sys.argv.index("--unit-size") + 1])
    strategies = (3, 2)
    if "--zero3" in sys.argv:
        strategies = (3,)
    print(f"unit coalescing: {unit_size}")
    print(
        "| world | ZeRO | row MB/step | whole MB/step | whole/row | padding (whole) "
        "| peak MB row | peak MB whole | whole/row | step ms row | step ms whole |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for world in (2, 4):
        for strategy in strategies:
            got = {
                mode: run_distributed(
                    measure, world, args=(mode, strategy, tiny, unit_size), timeout=900
                )[0]
                for mode in ("row", "whole")
            }
            (row, _, row_peak, row_ms), (whole, pad, peak, ms) = got["row"], got["whole"]
            print(
                f"| {world} | {strategy} | {row / 1e6:.1f} | {whole / 1e6:.1f} | "
                f"{whole / row:.3f} | {pad:.3f} | {row_peak / 1e6:.0f} | {peak / 1e6:.0f} | "
                f"{peak / row_peak:.2f} | {row_ms:.0f} | {ms:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
