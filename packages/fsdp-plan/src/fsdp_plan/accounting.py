"""Bytes from a ``ParamAndGradBuffer`` built on the meta device: arithmetic on its layouts.

Every figure is read off the buffers the real wrapping code built for one rank (their
layouts, dtypes and which of them are sharded), never from a formula over the parameter
count, so padding, bucketing, tied parameters, frozen groups and ``fsdp_no_shard``
groups come out as they will be. See the package README for what this cannot see.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fsdp_buffers import ParamAndGradBuffer
from fsdp_buffers.collectives import CollectiveKind, CommStats
from fsdp_buffers.no_shard import FSDP_WHOLE_ATTR

__all__ = [
    "OPTIMIZERS",
    "OPTIMIZER_STATES",
    "comm_per_step",
    "model_state_bytes",
    "optimizer_state_bytes",
    "state_dict_weight_bytes",
    "total_comm",
]

# Tensors of the shape of a parameter's main-weight piece each optimizer keeps, and
# whether it keeps a scalar ``step`` tensor per parameter (torch's default, non-capturable
# Adam/AdamW keep a 0-d float32 tensor).
OPTIMIZER_STATES: dict[str, tuple[int, bool]] = {
    "adamw": (2, True),
    "adam": (2, True),
    "sgd": (0, False),
    "sgd_momentum": (1, False),
}
# ``"muon"``: ``torch.optim.Muon`` (one ``momentum_buffer``, no ``step``) for the
# parameters marked for whole placement (``FSDP_WHOLE_ATTR``: what ``fully_shard`` marks
# from a Muon optimizer, ``fsdp_hooks.optim.optimizers.mark_whole_placement``), AdamW for the rest.
MUON_STATE = (1, False)
OPTIMIZERS = (*OPTIMIZER_STATES, "muon")
_STEP_BYTES = torch.empty((), dtype=torch.float32).element_size()


def _nbytes(buf) -> int:
    return 0 if buf is None else buf.nbytes


def model_state_bytes(buffer: ParamAndGradBuffer) -> dict[str, int]:
    """``parameters``, ``main_weights``, ``main_grads``: the persistent buffers' bytes.
    Main weights that are the model weights' pieces (same dtype) count 0, as memory."""
    out = {"parameters": 0, "main_weights": 0, "main_grads": 0}
    for gid, group in enumerate(buffer.groups):
        out["parameters"] += _nbytes(group.model_weight_buffer)
        out["main_weights"] += _nbytes(group.main_weight_buffer)
        outer = buffer.buckets[gid].outer
        fine = outer.fine_main if outer is not None else None  # a view when same dtype
        model = group.model_weight_buffer
        if fine is not None and (model is None or fine.dtype != model.dtype):
            out["main_weights"] += _nbytes(fine)
        out["main_grads"] += _nbytes(group.main_grad_buffer)
        bucket = buffer.buckets[gid]
        if bucket.grads.needs_grad_copy:  # the optimizer's gradients cast to the main weights'
            grads = bucket.grads.optimizer_grads
            out["main_grads"] += grads.numel * bucket.main_weights.element_size
    return out


def _piece_numels(layout, index: int, pieces: int) -> list[tuple[int, int, int]]:
    """Parameter ``index``'s ``torch.chunk`` pieces as runs ``(first, last, numel)``:
    pieces ``[first, last)`` hold ``numel`` elements each (Note [shard layout]: the
    first ``R // c`` pieces hold ``c`` rows, the next the rest, the others none)."""
    slot = layout.slots[index]
    c, rows = slot.chunk_rows, slot.rows
    full = min(rows // c, pieces) if c else 0
    runs = [(0, full, c * slot.row_numel)]
    if full < pieces and rows - full * c > 0:
        runs.append((full, full + 1, (rows - full * c) * slot.row_numel))
    return runs


def optimizer_state_bytes(
    buffer: ParamAndGradBuffer, optimizer: str, piece_of: dict[str, list[int]]
) -> list[int]:
    """Optimizer-state bytes on each global rank: per trainable parameter, ``tensors``
    copies of its
    main-weight piece (in the main-weight dtype: its ``torch.chunk`` rows when main
    weights are sharded, over shard x outer pieces, outer-major, when fully-sharded
    hybrid; else the whole parameter) plus a ``step`` scalar where the optimizer keeps
    one. ``piece_of[kind][r]``: the piece global rank ``r`` holds of a ``"dense"``,
    ``"expert"`` or ``"hybrid"`` (fully-sharded, shard x outer) group. Arithmetic per
    parameter, not per rank, so 1,024 ranks cost no more than 8. A whole-placed
    parameter (Note [whole placement] in ``fsdp_buffers.layout``) has all its state on
    its owner's piece; under ``"muon"`` the marked parameters keep Muon's state
    (``MUON_STATE``), the others AdamW's."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not one plan() knows; allowed: {OPTIMIZERS}")

    def state_of(p: torch.nn.Parameter) -> tuple[int, bool] | None:
        if not p.requires_grad:
            return None
        if optimizer != "muon":
            return OPTIMIZER_STATES[optimizer]
        return MUON_STATE if getattr(p, FSDP_WHOLE_ATTR, False) else OPTIMIZER_STATES["adamw"]

    return _piece_bytes(buffer, piece_of, state_of, whole_on_owner=True)


def state_dict_weight_bytes(
    buffer: ParamAndGradBuffer, piece_of: dict[str, list[int]]
) -> list[int]:
    """Bytes of the model state dict's parameters on each global rank: one copy of
    every parameter's main-weight piece, frozen ones included (a whole-placed one by
    rows, as its state-dict hook gives it). With ``optimizer_state_bytes``: what an
    asynchronous checkpoint stages in host memory (``checkpoint_staging``; module
    buffers, usually small, are not counted)."""
    return _piece_bytes(buffer, piece_of, lambda p: (1, False), whole_on_owner=False)


def _piece_bytes(
    buffer: ParamAndGradBuffer,
    piece_of: dict[str, list[int]],
    state_of: Callable[[torch.nn.Parameter], tuple[int, bool] | None],
    *,
    whole_on_owner: bool,
) -> list[int]:
    """Per global rank: for every parameter ``state_of`` gives ``(tensors, step)``,
    ``tensors`` copies of its main-weight piece plus a ``step`` scalar if asked (see
    ``optimizer_state_bytes``)."""
    everywhere = 0
    world_size = len(piece_of["dense"])
    # Per kind of group: a difference array over its pieces.
    diffs: dict[str, list[int]] = {}
    for gid, group in enumerate(buffer.groups):
        elem = buffer.buckets[gid].main_weights.element_size
        layout = buffer.buckets[gid].layout
        sharded = buffer.buckets[gid].sharding.main_weights
        if buffer.buckets[gid].outer_sharded:
            kind, pieces = "hybrid", world_size
        else:
            kind = "expert" if group.is_expert_param else "dense"
            pieces = buffer.buckets[gid].shard.size
        for i, p in enumerate(group.params):
            state = state_of(p)
            if state is None:
                continue
            tensors, step = state
            step_bytes = _STEP_BYTES if step else 0
            slot = layout.slots[i]
            if not sharded or slot.replicated:
                everywhere += step_bytes + tensors * slot.numel * elem
                continue
            diff = diffs.setdefault(kind, [0] * (pieces + 1))
            if slot.whole and not whole_on_owner:  # by torch.chunk rows (its state dict)
                rows = p.shape[0] if p.dim() else 1
                per = -(-rows // pieces)
                for k in range(pieces):
                    piece = max(0, min(per, rows - k * per)) * (slot.numel // rows)
                    diff[k] += tensors * piece * elem
                    diff[k + 1] -= tensors * piece * elem
                continue
            if slot.whole:  # all its state on its owner's piece
                assert slot.owner is not None
                whole = step_bytes + tensors * slot.numel * elem
                diff[slot.owner] += whole
                diff[slot.owner + 1] -= whole
                continue
            everywhere += step_bytes
            for first, last, numel in _piece_numels(layout, i, pieces):
                diff[first] += tensors * numel * elem
                diff[last] -= tensors * numel * elem
    out = [everywhere] * world_size
    for kind, diff in diffs.items():
        running, per_piece = 0, []
        for k in range(len(diff) - 1):
            running += diff[k]
            per_piece.append(running)
        for r, piece in enumerate(piece_of[kind]):
            out[r] += per_piece[piece]
    return out


def comm_per_step(buffer: ParamAndGradBuffer) -> dict[str, CommStats]:
    """The collectives one training step issues (forward, backward that syncs
    gradients, optimizer step), counted as ``comm_stats()`` counts them, by mesh dim:
    ``dp_shard`` (the shard group) and ``dp_outer`` (hybrid sharding's replicas)."""
    shard, outer_stats = CommStats(), CommStats()
    policy = buffer.policy
    roots = set(buffer.root_groups)
    for gid, group in enumerate(buffer.groups):
        mw = group.model_weight_buffer
        assert mw is not None
        n = buffer.buckets[gid].shard.size
        total = mw.layout.total_numel
        pad = mw.layout.padding_numel  # comm_stats()'s padding_bytes (whole placement)
        if mw.is_data_distributed:
            # Units gather for forward and again for backward; root buckets once.
            for _ in range(1 if gid in roots else 2):
                shard.record(CollectiveKind.ALL_GATHER, total, mw.element_size, n, pad)
        if not group.requires_grad:
            continue
        comm = torch.empty((), dtype=policy.grad_comm_dtype_for(group.dtype)).element_size()
        sharding = buffer.buckets[gid].sharding
        kind = (
            CollectiveKind.REDUCE_SCATTER
            if sharding.grads or sharding.main_weights
            else CollectiveKind.ALL_REDUCE
        )
        gbuf = group.main_grad_buffer
        assert gbuf is not None
        scattered = kind is CollectiveKind.REDUCE_SCATTER
        shard.record(kind, total, comm, n, gbuf.layout.padding_numel if scattered else 0)
        outer_sharding = buffer.buckets[gid].outer
        outer = outer_sharding.comm.size if outer_sharding is not None else 1
        if buffer.buckets[gid].outer_sharded:
            # Fully-sharded HSDP (Note [hybrid sharding]): reduce-scatter the coarse
            # main-grad shard across the outer group; after the step, all-gather the
            # updated fine pieces into the coarse compute shard.
            outer_stats.record(CollectiveKind.REDUCE_SCATTER, gbuf.data.numel(), comm, outer)
            outer_stats.record(CollectiveKind.ALL_GATHER, mw.data.numel(), mw.element_size, outer)
            continue
        if outer > 1:  # HSDP: all-reduce what the optimizer reads across the replicas
            numel = (
                gbuf.layout.shard_numel
                if sharding.main_weights or gbuf.is_data_distributed
                else gbuf.layout.total_numel
            )
            outer_stats.record(CollectiveKind.ALL_REDUCE, numel, comm, outer)
        if sharding.main_weights and not mw.is_data_distributed:
            shard.record(CollectiveKind.ALL_GATHER, total, mw.element_size, n, pad)
    return {"dp_shard": shard, "dp_outer": outer_stats}


def total_comm(by_dim: dict[str, CommStats]) -> CommStats:
    """The sum over mesh dims: what one ``comm_stats()`` reports."""
    out = CommStats()
    for stats in by_dim.values():
        for kind, count in stats.counts.items():
            mine = out.counts[kind]
            mine.calls += count.calls
            mine.numel += count.numel
            mine.bytes += count.bytes
            mine.traffic_bytes += count.traffic_bytes
            mine.padding_bytes += count.padding_bytes
    return out
