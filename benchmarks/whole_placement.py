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
    strategy: int, tiny: bool, unit_size: int | None = None
) -> dict[str, tuple[float, float]]:
    """(ring bytes each rank sends in one step, padding share of them) per placement;
    ``unit_size``: unit coalescing (``suggested_communication_unit_size``), which lets
    the owners of one bucket balance over several blocks' matrices."""
    from fsdp_hooks import fully_shard

    size = WORKLOADS[WORKLOAD].tiny if tiny else WORKLOADS[WORKLOAD].full
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for mode in ("row", "whole"):
        module = build_model(WORKLOAD, size)
        model, opts = fully_shard(
            module,
            _optimizers(module, mode),
            fsdp_unit_modules=unit_classes(WORKLOAD),
            zero_dp_strategy=strategy,
            suggested_communication_unit_size=unit_size,
        )
        opts = opts if isinstance(opts, list) else [opts]
        for step in range(2):  # the second step is measured
            model.reset_comm_stats()
            x, y = make_batch(WORKLOAD, size, step, rank, world, torch.device("cpu"))
            loss_of(WORKLOAD, model(*x), y).backward()
            for opt in opts:
                opt.step()
            for opt in opts:
                opt.zero_grad()
        stats = model.comm_stats().values()
        traffic = sum(c["traffic_bytes"] for c in stats)
        padding = sum(c["padding_bytes"] for c in stats) / sum(c["bytes"] for c in stats)
        out[mode] = (traffic, padding)
    return out


def main() -> None:
    tiny = "--tiny" in sys.argv
    # --unit-size N (elements): unit coalescing for both placements.
    unit_size = None
    if "--unit-size" in sys.argv:
        unit_size = int(sys.argv[sys.argv.index("--unit-size") + 1])
    print(f"unit coalescing: {unit_size}")
    print("| world | ZeRO | row MB/step | whole MB/step | whole/row | padding (whole) |")
    print("|---|---|---|---|---|---|")
    for world in (2, 4):
        for strategy in (3, 2):
            got = run_distributed(measure, world, args=(strategy, tiny, unit_size), timeout=900)[0]
            (row, _), (whole, pad) = got["row"], got["whole"]
            print(
                f"| {world} | {strategy} | {row / 1e6:.1f} | {whole / 1e6:.1f} | "
                f"{whole / row:.3f} | {pad:.3f} |"
            )


if __name__ == "__main__":
    main()
