"""The shared parity checks of ``fsdp_mesh.testing``: ``gather_rows`` rebuilds a tensor
from uneven row ranges (world size 2), and the comparisons fail on a difference past
their tolerances and pass within them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_mesh.testing import (
    assert_losses_close,
    assert_same_training,
    gather_rows,
    run_distributed,
)

FULL = torch.arange(21, dtype=torch.float32).reshape(7, 3)
ROWS = ((0, 5), (5, 7))  # uneven: not torch.chunk's 4/3


def _gather() -> torch.Tensor:
    r0, r1 = ROWS[dist.get_rank()]
    return gather_rows(FULL[r0:r1], (r0, r1))


def test_gather_rows_rebuilds_uneven_rows():
    for out in run_distributed(_gather, 2, timeout=60):
        assert torch.equal(out, FULL)


def test_losses_compared_step_by_step_within_rtol():
    losses = [1.0, 0.5, 0.25]
    assert_losses_close([x * (1 + 5e-6) for x in losses], losses)
    with pytest.raises(AssertionError, match="run A: losses differ"):
        assert_losses_close([1.0, 0.5, 0.25 * (1 + 2e-5)], losses, where="run A")
    assert_losses_close([1.0, 0.5, 0.25 + 5e-7], losses, atol=1e-6)


def test_same_training_checks_losses_and_every_parameter():
    ref = {"losses": [1.0, 0.5], "params": {"w": torch.ones(3), "b": torch.zeros(2)}}
    assert_same_training({"losses": [1.0, 0.5], "params": dict(ref["params"])}, ref)
    moved = {"w": torch.ones(3), "b": torch.tensor([0.0, 2e-6])}
    with pytest.raises(AssertionError, match="b"):
        assert_same_training({"losses": [1.0, 0.5], "params": moved}, ref)
    with pytest.raises(AssertionError, match="keys differ"):
        assert_same_training({"losses": [1.0, 0.5], "params": {"w": torch.ones(3)}}, ref)
    with pytest.raises(AssertionError, match="losses differ"):
        assert_same_training({"losses": [1.0, 0.6], "params": dict(ref["params"])}, ref)
