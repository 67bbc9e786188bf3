"""Wrapping options and initial values that differ across ranks (issue 19 item 5).

Only the parameters' names, shapes and dtypes used to be compared at wrap: a different
strategy on one rank hung, different units or ``grad_comm_dtype`` aborted in gloo,
``calculate_per_token_loss`` on one rank trained silently different weights, and a
per-rank seed left ZeRO-0 replicas diverged. Now a differing option raises at wrap, on
every rank, naming the option and the rank; differing initial values are replaced by
data-parallel rank 0's, as torch DDP does.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_buffers import MixedPrecisionPolicy
from fsdp_hooks import fully_shard
from fsdp_mesh.testing import run_distributed

WORLD = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def build(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(Block(), Block())


# name -> (keyword arguments of rank 0, of rank 1, what the error must name)
CASES = {
    "strategy": (
        {"zero_dp_strategy": 3},
        {"zero_dp_strategy": 2},
        "data_parallel_sharding_strategy",
    ),
    "units": ({"fsdp_unit_modules": [Block]}, {"fsdp_unit_modules": None}, "fsdp_unit_modules"),
    "grad_comm_dtype": (
        {"mixed_precision_policy": MixedPrecisionPolicy()},
        {"mixed_precision_policy": MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16)},
        "grad_comm_dtype=torch.bfloat16",
    ),
    "per_token_loss": ({}, {"calculate_per_token_loss": True}, "calculate_per_token_loss"),
    "double_buffer": ({}, {"fsdp_double_buffer": True}, "fsdp_double_buffer"),
    "overlap": (
        {"overlap_grad_reduce": True},
        {"overlap_grad_reduce": False},
        "overlap_grad_reduce=False",
    ),
}


def _wrap_with(case: str) -> str:
    """The error message of wrapping under ``case``, or "wrapped"."""
    rank = dist.get_rank()
    if case == "seed":
        module, kwargs = build(seed=rank), {"zero_dp_strategy": 0}
    elif case == "same":
        module, kwargs = build(), {}
    else:
        module, kwargs = build(), CASES[case][rank]
    kwargs = {"zero_dp_strategy": 3, "fsdp_unit_modules": [Block], **kwargs}
    optimizer = torch.optim.AdamW(module.parameters())
    try:
        model, _opt = fully_shard(module, optimizer, **kwargs)
    except ValueError as err:
        return str(err)
    if case == "seed":
        expected = dict(build(seed=0).named_parameters())
        got = model.buffer.views.full_parameters()
        same = all(torch.equal(got[n], expected[n].detach()) for n in expected)
        return "rank 0's values" if same else "values differ"
    return "wrapped"


def _wrap_each() -> dict[str, str]:
    # One process group for every case: a wrap that raised left nothing in flight.
    return {case: _wrap_with(case) for case in [*CASES, "seed", "same"]}


@pytest.fixture(scope="module")
def messages() -> list[dict[str, str]]:
    return run_distributed(_wrap_each, WORLD, timeout=90)


@pytest.mark.parametrize("case", list(CASES))
def test_differing_option_raises_on_every_rank(messages, case):
    for per_rank in messages:
        message = per_rank[case]
        assert "options differ across data-parallel ranks" in message, message
        assert CASES[case][2] in message and "rank 1" in message, message


def test_differing_initial_values_take_rank_0s(messages):
    """ZeRO-0 with a per-rank seed: every rank holds rank 0's model after wrapping."""
    assert [m["seed"] for m in messages] == ["rank 0's values"] * WORLD


def test_same_options_and_values_wrap(messages):
    assert [m["same"] for m in messages] == ["wrapped"] * WORLD
