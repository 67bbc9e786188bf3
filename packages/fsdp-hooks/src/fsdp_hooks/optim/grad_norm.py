"""``clip_grad_norm_`` over a wrapped model's main gradients, whatever its meshes.

``torch.nn.utils.clip_grad_norm_`` works on our DTensor parameters while they all live
on one mesh (plain FSDP, HSDP, tp). With an expert mesh it cannot: dense and expert
gradients are DTensors on different meshes (``aten.stack`` refuses to mix them), and
an expert DTensor only describes this rank's experts, so even a per-mesh norm would
miss the experts other expert-parallel ranks hold.

Here the norm is taken per mesh (each DTensor norm reduces over its own mesh, so it
covers every element of those parameters once), and the expert part is then combined
over the whole world: each set of experts is held by ``expt_dp_size`` ranks (its
expert data-parallel replicas), so the world sum of the expert ``norm^p`` counts every
expert that many times. The inf-norm is the max over the local pieces of each mesh
(and over the world for experts). Clipping scales the local gradient shards in place.

Whole-placed parameters (Note [whole placement] in ``fsdp_buffers.layout``) have plain
gradients on their owner only: their ``norm^p`` (or max) is reduced over each shard group
that holds some, as a row shard's would be. ``torch.nn.utils.clip_grad_norm_`` cannot
know that and would take them as local: use ``model.clip_grad_norm_`` with them.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_buffers import ParamAndGradBuffer

__all__ = ["clip_grad_norm_", "total_grad_norm"]


def _combine(norms: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """The norm of the concatenation of vectors with these norms (0 for none)."""
    if not norms:
        return torch.zeros((), device=device)
    stacked = torch.stack([n.float().to(device) for n in norms])
    if math.isinf(norm_type):
        return stacked.max()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)


def _by_mesh(grads: list[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    """Gradients by DTensor mesh (None for plain tensors), in first-seen order, which is
    the same on every rank."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    return by_mesh


def _norm_over_meshes(
    grads: list[torch.Tensor], norm_type: float, foreach: bool | None, device: torch.device
) -> torch.Tensor:
    norms = []
    for group in _by_mesh(grads).values():
        n = torch.nn.utils.get_total_norm(group, norm_type, foreach=foreach)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    return _combine(norms, norm_type, device)


def _max_over_meshes(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    peaks = []
    for mesh, group in _by_mesh(grads).items():
        local = [g.to_local() if isinstance(g, DTensor) else g for g in group]
        peak = _combine([t.abs().max() for t in local if t.numel()], math.inf, device)
        for dim in range(mesh.ndim if mesh is not None else 0):
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
        peaks.append(peak)
    return _combine(peaks, math.inf, device)


def total_grad_norm(
    buffer: ParamAndGradBuffer,
    *,
    expert_replicas: int | None,
    norm_type: float = 2.0,
    foreach: bool | None = None,
) -> torch.Tensor:
    """The ``norm_type``-norm of every trainable parameter's main gradient, the same
    on every rank. ``expert_replicas``: ranks holding each set of experts when experts
    differ across ranks (expert parallelism), else None (experts are dense here)."""
    norm_type = float(norm_type)
    dense: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    attr = buffer.views.grad_attr  # .grad, or .decoupled_grad (use_decoupled_grad)
    whole: dict[int, list[torch.Tensor]] = {}  # gid -> whole-placed grads held here
    for _name, param in buffer.views.optimizer_named_parameters():
        gid, _ = param._fsdp_group_index  # type: ignore[attr-defined]
        grad = getattr(param, attr, None)
        if hasattr(param, "_fsdp_whole_owner"):
            whole.setdefault(gid, [])
            if grad is not None:
                whole[gid].append(grad)
            continue
        if grad is None:
            continue
        split = expert_replicas is not None and buffer.groups[gid].is_expert_param
        (expert if split else dense).append(grad)
    device = buffer.device
    whole_part = _whole_norm(buffer, whole, norm_type, device)
    if math.isinf(norm_type):
        # A max needs no care for replicas: the max of the local pieces over each mesh
        # (not DTensor's norm: _foreach_norm refuses the empty pieces uneven shards have).
        peak = _max_over_meshes(dense + expert, device)
        if expert_replicas is not None:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # other ranks' experts
        return _combine([peak, whole_part], norm_type, device) if whole else peak
    parts = [_norm_over_meshes(dense, norm_type, foreach, device)]
    if whole:
        parts.append(whole_part)
    if expert_replicas is not None:
        local_p = _norm_over_meshes(expert, norm_type, foreach, device).pow(norm_type)
        dist.all_reduce(local_p)
        parts.append((local_p / expert_replicas).pow(1.0 / norm_type))
    return _combine(parts, norm_type, device)


def _whole_norm(
    buffer: ParamAndGradBuffer,
    whole: dict[int, list[torch.Tensor]],
    norm_type: float,
    device: torch.device,
) -> torch.Tensor:
    """The norm of the whole-placed gradients: each bucket's owners' ``norm^p`` (max)
    reduced over its shard group, one reduction per distinct group, in bucket order."""
    by_group: dict[int, tuple[object, list[torch.Tensor]]] = {}
    for gid, grads in whole.items():
        pg = buffer.buckets[gid].shard.group
        by_group.setdefault(id(pg), (pg, []))[1].extend(grads)
    parts = []
    for pg, grads in by_group.values():
        if math.isinf(norm_type):
            local = _combine([g.abs().max() for g in grads if g.numel()], math.inf, device)
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=pg)
            parts.append(local)
        else:
            local = _combine(
                [torch.linalg.vector_norm(g, norm_type) for g in grads], norm_type, device
            ).pow(norm_type)
            dist.all_reduce(local, group=pg)
            parts.append(local.pow(1.0 / norm_type))
    return _combine(parts, norm_type, device)


def clip_grad_norm_(
    buffer: ParamAndGradBuffer,
    max_norm: float,
    *,
    expert_replicas: int | None,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale every main gradient so that their total norm is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does; returns the total norm before clipping."""
    total = total_grad_norm(
        buffer, expert_replicas=expert_replicas, norm_type=norm_type, foreach=foreach
    )
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is {total.item()}, so "
            f"they cannot be clipped; pass error_if_nonfinite=False to clip anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    # As torch's ``_clip_grads_with_norm_``: one ``_foreach_mul_`` per (device, dtype),
    # the coefficient converted once per group (to the gradients' dtype, as before).
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    with torch.no_grad():
        for _name, param in buffer.views.optimizer_named_parameters():
            grad = getattr(param, buffer.views.grad_attr, None)
            if grad is not None:
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                groups.setdefault((local.device, local.dtype), []).append(local)
        for (device, dtype), locals_ in groups.items():
            scale = coef.to(device=device, dtype=dtype)
            if foreach is False:
                for local in locals_:
                    local.mul_(scale)
            else:
                torch._foreach_mul_(locals_, scale)
    return total
