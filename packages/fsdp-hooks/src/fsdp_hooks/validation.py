"""Checks at wrap time that turn bad input into a clear error on every rank."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

from fsdp_mesh import warn_once

__all__ = ["check_cuda_only_options", "check_not_wrapped", "check_same_model"]


def check_not_wrapped(module: nn.Module) -> None:
    if getattr(module, "_is_fsdp_wrapper", False) or any(
        getattr(m, "_is_fsdp_wrapper", False) for m in module.modules()
    ):
        raise ValueError(
            "the module is already wrapped by fsdp (it is, or contains, a MegatronFSDP "
            "module); wrap the original module once"
        )
    # Compute parameters carry ``_fsdp_managed``; the DTensor parameters that replace
    # them outside forward (``wrapper.module``'s, between steps) carry ``_fsdp_model_ref``.
    managed = [
        n
        for n, p in module.named_parameters()
        if getattr(p, "_fsdp_managed", False) or getattr(p, "_fsdp_model_ref", None) is not None
    ]
    if managed:
        raise ValueError(
            f"parameters {managed[:5]} already belong to an fsdp-wrapped model; wrap "
            f"the original module once"
        )


def check_cuda_only_options(device: torch.device, **options: bool) -> None:
    """CUDA/NCCL-only options are accepted everywhere; off CUDA they are ignored with
    one warning per option per process."""
    if device.type == "cuda":
        return
    for name, value in options.items():
        if value:
            warn_once(
                f"fsdp.cuda_only.{name}",
                f"{name}=True only has an effect with CUDA/NCCL; ignored on {device.type}",
            )


def _fingerprint(module: nn.Module) -> list[tuple[str, tuple[int, ...], str, bool]]:
    return [
        (name, tuple(p.shape), str(p.dtype), p.requires_grad)
        for name, p in module.named_parameters()
    ]


def check_same_model(module: nn.Module, dist_index) -> None:
    """Every data-parallel rank must wrap the same model: compare a fingerprint of
    parameter names, shapes, dtypes and requires_grad, so that a mismatch raises here
    instead of hanging in the first collective."""
    if not dist.is_initialized():
        return
    group = dist_index.get_dp_group()
    entries = _fingerprint(module)
    digest = hashlib.sha256(repr(entries).encode()).digest()
    value = int.from_bytes(digest[:7], "little")  # fits in int64
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist_index.device_type == "cuda"
        else torch.device("cpu")
    )
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    if all(int(t.item()) == value for t in everyone):
        return
    summaries: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(summaries, (dist.get_rank(), entries), group=group)
    reference_rank, reference = summaries[0]  # type: ignore[misc]
    problems = []
    for rank, other in summaries[1:]:  # type: ignore[misc]
        if other != reference:
            diff = next(
                (f"{a} vs {b}" for a, b in zip(reference, other, strict=False) if a != b),
                f"{len(reference)} parameters vs {len(other)}",
            )
            problems.append(f"rank {rank} differs from rank {reference_rank}: {diff}")
    raise ValueError(
        "the model differs across data-parallel ranks (parameter name, shape, dtype or "
        "requires_grad); every rank must build the same model before wrapping:\n"
        + "\n".join(problems)
    )
