"""``fsdp-demo``: parse, launch the ranks, plot, and say where everything went.

Started by hand, it launches ``--nproc`` local ranks itself (torch's elastic launcher,
in this process). Started by ``torchrun`` (one process per rank, on one node or many:
``torchrun ... -m fsdp.demo``), each process is one rank and ``--nproc`` is ignored.
Either way each rank trains on ``--batch-size`` sequences a step, so the global batch
is ``--batch-size`` times the number of ranks that actually run.
"""

from __future__ import annotations

import sys
import time

from fsdp.demo.options import DemoOptions, parse_args, under_torchrun

__all__ = ["main"]


def _run(options: DemoOptions) -> dict | None:
    """Rank 0's summary (None on the other ranks under torchrun)."""
    if under_torchrun():
        from fsdp.demo.train import run_rank

        return run_rank(options)
    from fsdp.demo.launch import launch

    return launch(options)


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)  # exits with status 2 and a message on bad arguments
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from fsdp.demo.plot import PLOT_FILE, plot_run
    from fsdp.demo.train import METRICS_FILE

    began = time.perf_counter()
    try:
        summary = _run(options)
    except ChildFailedError as err:
        print(f"fsdp-demo: a rank failed:\n{err.format_msg()}", file=sys.stderr)
        return 1
    if summary is None:
        return 0  # not rank 0: rank 0 reports
    plot = plot_run(summary, options.out / PLOT_FILE)
    history = summary["history"]
    first, last = history[0]["loss"], history[-1]["loss"]
    print(
        f"fsdp-demo: {len(history)} steps in total; loss {first:.3f} at step "
        f"{history[0]['step']} -> {last:.3f} at step {history[-1]['step']} "
        f"({time.perf_counter() - began:.0f} s for this run)\n"
        f"  checkpoint: {summary['checkpoint']}\n"
        f"  saving it blocked training {summary['checkpoint_blocked_s']:.3f} s (asynchronous)\n"
        f"  plot:       {plot}\n"
        f"  metrics:    {options.out / METRICS_FILE}"
    )
    return 0
