"""Checks that parity tests share: a value averaged over the ranks, and whole dicts of
tensors compared with the one-process reference."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

__all__ = ["assert_tensors_close", "mean_over_ranks"]


def mean_over_ranks(value: torch.Tensor | float) -> float:
    """The mean of ``value`` over every rank (a collective): with equal slices of a
    global batch, the mean of the ranks' losses is the loss of the whole batch."""
    total = torch.as_tensor(value).detach().clone().float()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def assert_tensors_close(
    got: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    where: str = "",
) -> None:
    """The same keys, and every tensor close to its reference; a failure names it."""
    assert set(got) == set(expected), f"{where}: keys differ: {set(got) ^ set(expected)}"
    for name, value in expected.items():
        torch.testing.assert_close(
            got[name], value, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{where} {n}: {m}"
        )
