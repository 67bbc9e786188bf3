"""The multi-process test harness every fsdp package's tests use.

``run_distributed(fn, world_size)`` runs a module-level function on N ranks (gloo on
CPU, nccl when there are N GPUs) and returns their results, or fails with every
failing rank's traceback, or with the names and stacks of the ranks that hung.
``mean_over_ranks`` and ``assert_tensors_close`` are the checks parity tests share.
"""

from fsdp_mesh.testing._runner import (
    DistributedTestError,
    DistributedTestTimeout,
    RankFailure,
    run_distributed,
)
from fsdp_mesh.testing.checks import assert_tensors_close, mean_over_ranks

__all__ = [
    "DistributedTestError",
    "DistributedTestTimeout",
    "RankFailure",
    "assert_tensors_close",
    "mean_over_ranks",
    "run_distributed",
]
