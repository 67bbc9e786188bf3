"""Checks that parity tests share: a value averaged over the ranks, a tensor gathered
from the ranks' row ranges, and losses and whole dicts of tensors compared with the
one-process reference."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fsdp_mesh.testing._runner import harness_device

__all__ = [
    "assert_losses_close",
    "assert_same_training",
    "assert_tensors_close",
    "gather_rows",
    "mean_over_ranks",
]


def mean_over_ranks(value: torch.Tensor | float) -> float:
    """The mean of ``value`` over every rank (a collective): with equal slices of a
    global batch, the mean of the ranks' losses is the loss of the whole batch."""
    total = torch.as_tensor(value).detach().clone().float().to(harness_device())
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def gather_rows(local: torch.Tensor, rows: tuple[int, int]) -> torch.Tensor:
    """The whole tensor from every rank's dim-0 rows (a collective over the default
    group): this rank holds rows ``rows`` = [start, end) as ``local``. For shards whose
    rows are not where DTensor's metadata puts them, so ``full_tensor()`` does not apply."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (tuple(rows), local.detach().cpu().clone()))
    end = max(r1 for (_r0, r1), _part in parts)
    out = torch.empty((end, *local.shape[1:]), dtype=local.dtype)
    for (r0, r1), part in parts:
        out[r0:r1] = part
    return out


def assert_losses_close(
    got: Sequence[float],
    expected: Sequence[float],
    *,
    rtol: float = 1e-5,
    atol: float = 0.0,
    where: str = "",
) -> None:
    """Step-by-step values (losses, norms) close to the reference's, compared in float64."""
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        rtol=rtol,
        atol=atol,
        msg=lambda m: f"{where}: losses differ: {m}",
    )


def assert_same_training(
    got: Mapping[str, Any], expected: Mapping[str, Any], *, where: str = "", loss_atol: float = 0.0
) -> None:
    """A run's ``"losses"`` (step by step, within 1e-5 relative) and final ``"params"``
    (within 1e-5 relative, 1e-6 absolute) are the one-process reference's."""
    assert_losses_close(got["losses"], expected["losses"], atol=loss_atol, where=where)
    assert_tensors_close(got["params"], expected["params"], where=where)


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


def held_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of memory the storages of ``tensors`` span, each byte once: the union of
    their storages' address ranges. Two storages over one memory (a view's, an alias's
    made with DLPack, as fsdp's DTensor views are) count once, where summing storages by
    identity or address would count the alias again. Storages without bytes (released
    buckets, meta tensors) count nothing."""
    spans = sorted(
        (s.data_ptr(), s.data_ptr() + s.nbytes())
        for s in (t.untyped_storage() for t in tensors)
        if s.nbytes() and s.data_ptr()
    )
    total, end = 0, 0
    for start, stop in spans:
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total
