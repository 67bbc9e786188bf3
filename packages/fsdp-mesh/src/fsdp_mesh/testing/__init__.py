"""The multi-process test harness every fsdp package's tests use.

``run_distributed(fn, world_size)`` runs a module-level function on N ranks and returns
their results, or fails with every failing rank's traceback, or with the names and
stacks of the ranks that hung. Ranks run on CPU (gloo) unless ``FSDP_TEST_DEVICE=cuda``
(or pytest's ``--fsdp-device cuda``) asks for CUDA + NCCL, one GPU per rank: then a test
needing more ranks than GPUs skips, ``world_sizes(2, 4)`` parametrizes at the world
sizes the GPUs allow, and ``harness_device()`` is where a test's tensors belong.
``mean_over_ranks``, ``gather_rows``, ``assert_losses_close``, ``assert_tensors_close``
and ``assert_same_training`` (losses and parameters) are the checks parity tests share;
``held_storage_bytes`` is the memory a set of tensors' storages span, each byte once.
"""

from fsdp_mesh.testing._runner import (
    TEST_DEVICE_ENV,
    DistributedTestError,
    DistributedTestTimeout,
    RankFailure,
    harness_device,
    harness_device_type,
    run_distributed,
    world_sizes,
)
from fsdp_mesh.testing.checks import (
    assert_losses_close,
    assert_same_training,
    assert_tensors_close,
    gather_rows,
    held_storage_bytes,
    mean_over_ranks,
)
from fsdp_mesh.testing.siblings import load_sibling

__all__ = [
    "TEST_DEVICE_ENV",
    "DistributedTestError",
    "DistributedTestTimeout",
    "RankFailure",
    "assert_losses_close",
    "assert_same_training",
    "assert_tensors_close",
    "gather_rows",
    "harness_device",
    "harness_device_type",
    "held_storage_bytes",
    "load_sibling",
    "mean_over_ranks",
    "run_distributed",
    "world_sizes",
]
