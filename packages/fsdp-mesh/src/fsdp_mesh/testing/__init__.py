"""The multi-process test harness every fsdp package's tests use.

``run_distributed(fn, world_size)`` runs a module-level function on N ranks (gloo on
CPU, nccl when there are N GPUs) and returns their results, or fails with every
failing rank's traceback, or with the names and stacks of the ranks that hung.
``mean_over_ranks``, ``gather_rows``, ``assert_losses_close``, ``assert_tensors_close``
and ``assert_same_training`` (losses and parameters) are the checks parity tests share.
"""

from fsdp_mesh.testing._runner import (
    DistributedTestError,
    DistributedTestTimeout,
    RankFailure,
    run_distributed,
)
from fsdp_mesh.testing.checks import (
    assert_losses_close,
    assert_same_training,
    assert_tensors_close,
    gather_rows,
    mean_over_ranks,
)

__all__ = [
    "DistributedTestError",
    "DistributedTestTimeout",
    "RankFailure",
    "assert_losses_close",
    "assert_same_training",
    "assert_tensors_close",
    "gather_rows",
    "mean_over_ranks",
    "run_distributed",
]
