"""Start the ranks in this process with torch's elastic launcher (what torchrun uses)."""

from __future__ import annotations

import uuid
from typing import Any

from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from fsdp.demo.options import DemoOptions
from fsdp.demo.train import run_rank

__all__ = ["launch"]


def launch(options: DemoOptions) -> dict[str, Any]:
    """Run ``run_rank(options)`` on ``options.nproc`` local ranks; return rank 0's
    summary. A failing rank raises ``ChildFailedError`` with its traceback."""
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=options.nproc,
        run_id=f"fsdp-demo-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # any free port
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    results = elastic_launch(config, run_rank)(options)
    return results[0]
