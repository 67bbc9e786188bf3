"""``plan()``: what one rank of an fsdp job will hold and move, before launch.

It runs the real wrapping code (``FSDPDistributedIndex`` over a ``DeviceMesh``, then
``ParamAndGradBuffer`` with the arguments ``MegatronFSDP`` gives it) for one rank of a
fake world of ``world_size`` ranks, on a meta-device copy of the module: nothing is
allocated and no peer is needed, so a plan for 1,024 ranks takes seconds. The bytes
are then read off the buffers it built (``accounting``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_buffers import MixedPrecisionPolicy, ParamAndGradBuffer, ShardingStrategy
from fsdp_buffers.collectives import CollectiveKind
from fsdp_buffers.no_shard import FSDP_WHOLE_ATTR, copy_param_attributes
from fsdp_buffers.param_group import resolve_communication_units
from fsdp_hooks import DistributedDataParallelConfig
from fsdp_hooks.features.experts import resolve_is_expert_param
from fsdp_hooks.optim.optimizers import muon_needs_whole
from fsdp_hooks.setup.validation import check_hybrid_index, check_outer_strategy, check_param_dtype
from fsdp_mesh import FSDPDistributedIndex, build_device_mesh
from fsdp_plan.accounting import (
    OPTIMIZERS,
    comm_per_step,
    model_state_bytes,
    optimizer_state_bytes,
    state_dict_weight_bytes,
    total_comm,
)
from fsdp_plan.activations import forward_inputs, meta_activations
from fsdp_plan.fake_world import fake_world
from fsdp_plan.gathered import gathered_peak

__all__ = ["MODEL_STATE_KEYS", "Plan", "plan"]

MODEL_STATE_KEYS = ("parameters", "main_weights", "main_grads", "optimizer_state")
# What ``peak`` sums (``activations`` only when the plan has inputs).
PEAK_KEYS = (*MODEL_STATE_KEYS, "gathered_peak", "activations")
_KINDS = {
    "all_gather": CollectiveKind.ALL_GATHER,
    "reduce_scatter": CollectiveKind.REDUCE_SCATTER,
    "all_reduce": CollectiveKind.ALL_REDUCE,
}

# fully_shard_model options that change what is held or moved, and plan() models.
_MODELED = {
    "fsdp_unit_modules",
    "zero_dp_strategy",
    "mixed_precision_policy",
    "disable_bucketing",
    "fsdp_double_buffer",
    "maxpool_double_buffer",
    "is_expert_param",
    "outer_dp_sharding_strategy",
    "suggested_communication_unit_size",
    "prefetch_depth",
    "overlap_param_gather",  # which ZeRO-1/2 weight gathers are in flight together
}
# Options that change only when or how (not how many bytes), accepted as given.
_NO_BYTES = {
    "overlap_grad_reduce",
    "sync_model_each_microbatch",
    "preproc_state_dict_for_dcp_ckpt",
    "report_nan_in_param_grad",
    "average_in_collective",
    "calculate_per_token_loss",
    "regather_saved_weights",
    "init_model_with_meta_device",
    "keep_fp8_transpose_cache",
    "disable_symmetric_registration",
    "enable_fine_grained_param_gather",
    "use_decoupled_grad",
    "cuda_graph_mode",
    "fsdp_db_use_persist_buf_on_alloc_fail",
    "device",
    "dp_shard_dim",  # a name: plan() builds the mesh (fsdp_mesh.build_device_mesh)
}
# Options whose meshes plan() cannot build on a fake world yet: refused, never guessed.
_NOT_YET = {
    "device_mesh": "a given device_mesh (plan() builds a 1-D mesh over world_size ranks)",
    "dp_outer_dim": "a named outer dim (dp_outer_dim; pass dp_outer=<size> instead)",
    "hybrid_fsdp_group": "a given hybrid group (hybrid_fsdp_group; pass dp_outer=<size>)",
    "hybrid_fsdp_expt_group": "hybrid sharding of experts (hybrid_fsdp_expt_group)",
    "tp_dim": "a named tp dim (tp_dim; pass tp=<size> instead)",
    "expt_device_mesh": "a given expert mesh (expt_device_mesh; pass ep=<size>)",
    "fsdp_group_ag": "a separate all-gather group (fsdp_group_ag)",
    "expt_fsdp_group_ag": "a separate expert all-gather group (expt_fsdp_group_ag)",
    "nccl_ub": "NCCL user buffers (nccl_ub)",
}
_FALSY_DEFAULTS = {"nccl_ub": (False,)}


@dataclass(frozen=True)
class Plan:
    """What each rank holds and moves, in bytes.

    ``per_rank``: the rank with the largest ``peak`` (rank 0: ``torch.chunk`` gives the
    first ranks the most rows): ``parameters``, ``main_weights``, ``main_grads``,
    ``optimizer_state``, ``gathered_peak``, ``activations`` (only when the plan was
    given inputs), ``peak`` (their sum), ``checkpoint_staging`` (host memory, not in
    ``peak``: what ``save_checkpoint(..., asynchronous=True)`` keeps staged, one copy of
    this rank's pieces of the weights and optimizer state), and per step
    ``all_gather``, ``reduce_scatter``, ``all_reduce`` (ring traffic each rank sends,
    ``comm_stats()``'s ``traffic_bytes``). ``ranks``: the figures of every other rank
    whose figures differ, keyed by the lowest rank that has them (empty when all ranks
    are alike). ``comm``: per step, as ``model.comm_stats()`` reports one step;
    ``comm_by_dim``: the same split by mesh dim (``dp_shard``, ``dp_outer``).
    """

    world_size: int
    strategy: str
    per_rank: dict[str, int]
    ranks: dict[int, dict[str, int]] = field(default_factory=dict)
    comm: dict[str, dict[str, float]] = field(default_factory=dict)
    comm_by_dim: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    options: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "strategy": self.strategy,
            "per_rank": dict(self.per_rank),
            "ranks": {str(k): dict(v) for k, v in self.ranks.items()},
            "comm": {k: dict(v) for k, v in self.comm.items()},
            "comm_by_dim": {
                dim: {k: dict(v) for k, v in c.items()} for dim, c in self.comm_by_dim.items()
            },
            "options": dict(self.options),
        }


def _meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are on the meta device (ties
    kept: a tensor reachable twice maps to one meta tensor); ``module`` is untouched and
    no storage is allocated."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        if isinstance(p, DTensor):
            raise NotImplementedError(
                "plan() takes tensor parallelism as tp=<size> over a module that holds one "
                "tp rank's pieces as plain tensors marked as Megatron-Core marks them "
                "(tensor_model_parallel=True, partition_dim, partition_stride=1), not as "
                "DTensor parameters (they need the job's process group)"
            )
        meta = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
        # fsdp_no_shard marks and Megatron-Core's tensor-parallel attributes.
        memo[id(p)] = copy_param_attributes(p, meta)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


def _coords(mesh, dim: str, world_size: int) -> list[int]:
    """Each global rank's coordinate along ``dim`` of ``mesh``."""
    grid = mesh.mesh.movedim(mesh.mesh_dim_names.index(dim), 0)
    out = [0] * world_size
    for c in range(grid.shape[0]):
        for r in grid[c].flatten().tolist():
            out[r] = c
    return out


def _pieces(meshes, world_size: int) -> dict[str, list[int]]:
    """The piece each global rank holds of a dense, an expert and a fully-sharded
    hybrid group (outer-major over shard x outer: Note [hybrid sharding])."""
    shard = _coords(meshes.device_mesh, "dp_shard", world_size)
    outer = _coords(meshes.device_mesh, "dp_outer", world_size)
    size = meshes.device_mesh.size(meshes.device_mesh.mesh_dim_names.index("dp_shard"))
    expert_mesh = meshes.expt_device_mesh
    return {
        "dense": shard,
        "hybrid": [o * size + k for o, k in zip(outer, shard, strict=True)],
        "expert": shard if expert_mesh is None else _coords(expert_mesh, "dp_shard", world_size),
    }


def _mark_muon(meta: nn.Module, muon_params: Callable[[str, nn.Parameter], bool] | None) -> None:
    """Mark what ``fully_shard(model, [Muon(hidden), AdamW(rest)])`` places whole: the
    trainable parameters Muon needs whole (``fsdp_hooks.optim.optimizers.muon_needs_whole``) that
    ``muon_params(name, param)`` selects (all of them without it)."""
    if muon_params is not None and not callable(muon_params):
        raise TypeError(
            f"muon_params must be a callable (name, parameter) -> bool; got {muon_params!r:.80}"
        )
    for name, p in meta.named_parameters():
        if (
            p.requires_grad
            and muon_needs_whole(p)
            and (muon_params is None or muon_params(name, p))
        ):
            setattr(p, FSDP_WHOLE_ATTR, True)


def _check_options(options: dict[str, Any]) -> None:
    for name, value in options.items():
        if name in _NOT_YET:
            if value is None or value in _FALSY_DEFAULTS.get(name, ()):
                continue
            raise NotImplementedError(
                f"plan() cannot model {_NOT_YET[name]} yet: its meshes are not built on the "
                "fake process group; plan without it, or measure with "
                "model.memory_stats() / comm_stats()"
            )
        if name not in _MODELED and name not in _NO_BYTES:
            allowed = sorted(_MODELED | _NO_BYTES)
            raise TypeError(f"plan() got an unexpected option {name!r}; allowed: {allowed}")


def plan(
    module: nn.Module,
    world_size: int,
    *,
    dp_outer: int = 1,
    tp: int = 1,
    ep: int = 1,
    optimizer: str = "adamw",
    muon_params: Callable[[str, nn.Parameter], bool] | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    example_inputs: Any = None,
    **options: Any,
) -> Plan:
    """Predict, for ``fully_shard_model(module, **options)`` over ``world_size`` ranks
    (``world_size / (dp_outer * tp)`` ranks per shard group and, with ``dp_outer`` > 1,
    that many replicas: hybrid sharding, fully sharded with
    ``outer_dp_sharding_strategy="optim"``; with ``tp`` > 1 a tensor-parallel dim of
    ``tp`` ranks, ``module`` then holding one tp rank's pieces, marked as Megatron-Core
    marks them (``tensor_model_parallel``, ``partition_dim``; unmarked parameters are
    replicated over tp); with ``ep`` > 1 an expert mesh of ``ep`` expert-parallel ranks,
    ``module`` then holding one rank's experts; ranks laid out as
    ``fsdp_mesh.build_device_mesh`` lays them), the model-state bytes each rank holds,
    the gathered bytes
    at once, and the bytes each step moves. ``optimizer``: one of
    ``fsdp_plan.accounting.OPTIMIZERS`` ("adamw", "adam", "sgd", "sgd_momentum",
    "muon"). ``"muon"`` plans ``fully_shard(module, [Muon(matrices), AdamW(rest)])``:
    the trainable >= 2-D parameters (those ``muon_params(name, param)`` selects, e.g.
    the hidden matrices without embedding and head; all of them without it) are placed
    whole on one rank each by the library's own owner assignment, with one momentum
    buffer; the others are AdamW's. ``batch_size`` and ``seq_len`` (token ids of that shape, one
    rank's micro-batch) or ``example_inputs`` (a tensor, a tuple of positional or a dict
    of keyword arguments) add ``activations``: the tensors a meta-device training
    forward saves for backward (``fsdp_plan.activations``). ``module`` is not modified;
    build it under ``torch.device("meta")`` to plan a model that does not fit in host
    memory."""
    inputs = forward_inputs(batch_size, seq_len, example_inputs)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not one plan() knows; allowed: {OPTIMIZERS}")
    if muon_params is not None and optimizer != "muon":
        raise ValueError(f"muon_params is for optimizer='muon'; got optimizer={optimizer!r}")
    _check_options(options)
    strategy = ShardingStrategy.parse(options.get("zero_dp_strategy", 3))
    outer = ShardingStrategy.parse(options.get("outer_dp_sharding_strategy", 0))
    for name, value in (("dp_outer", dp_outer), ("tp", tp), ("ep", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}")
    if not isinstance(world_size, int) or world_size % (dp_outer * tp):
        raise ValueError(f"dp_outer x tp = {dp_outer} x {tp} must divide world_size={world_size!r}")
    check_outer_strategy(strategy, outer, dp_outer > 1, "plan")
    policy = options.get("mixed_precision_policy") or MixedPrecisionPolicy()
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mixed_precision_policy must be a MixedPrecisionPolicy; got {type(policy).__name__}"
        )
    double_buffer = bool(options.get("fsdp_double_buffer") or options.get("maxpool_double_buffer"))
    meta = _meta_copy(module)
    if optimizer == "muon":
        _mark_muon(meta, muon_params)
    activations = None if inputs is None else meta_activations(meta, *inputs)
    with fake_world(world_size, rank=0):
        meshes = build_device_mesh(
            dp_shard=world_size // (dp_outer * tp),
            dp_outer=dp_outer,
            tp=tp,
            expert_parallel=ep if ep > 1 else None,
            device_type="cpu",
        )
        index = FSDPDistributedIndex(
            **meshes.fsdp_kwargs(), hsdp_outer_dp_shard=outer is ShardingStrategy.OPTIM
        )
        # The wrapper's own checks: what it refuses, plan() refuses too.
        check_hybrid_index(index, strategy, outer, False)
        check_param_dtype(meta, policy)
        unit_size, unit_max = resolve_communication_units(
            options.get("suggested_communication_unit_size"), strategy.shards_model_weights
        )
        buffer = ParamAndGradBuffer(
            meta,
            index,
            strategy=strategy,
            mixed_precision_policy=policy,
            fsdp_unit_modules=options.get("fsdp_unit_modules"),
            bucket_size=DistributedDataParallelConfig().bucket_size,
            disable_bucketing=bool(options.get("disable_bucketing", False)),
            device=torch.device("meta"),
            fsdp_double_buffer=double_buffer,
            is_expert_param=resolve_is_expert_param(
                options.get("is_expert_param"), index.has_expert_mesh
            ),
            allow_meta=True,
            communication_unit_size=unit_size,
            communication_unit_max_units=unit_max,
        )
        held = model_state_bytes(buffer)
        peak = gathered_peak(
            buffer,
            options.get("prefetch_depth", 1),
            bool(options.get("overlap_param_gather", True)),
        )
        by_dim = comm_per_step(buffer)
        comm = total_comm(by_dim)
        # Ranks differ only in the optimizer state of torch.chunk pieces (the buffers'
        # shards are equal-sized by construction).
        pieces = _pieces(meshes, world_size)
        optim = optimizer_state_bytes(buffer, optimizer, pieces)
        weights = state_dict_weight_bytes(buffer, pieces)
    traffic = {k: round(comm[kind].traffic_bytes) for k, kind in _KINDS.items()}

    def figures(rank: int) -> dict[str, int]:
        out = dict(held)
        out["optimizer_state"] = optim[rank]
        out["gathered_peak"] = peak
        if activations is not None:
            out["activations"] = activations
        out["peak"] = sum(out.get(k, 0) for k in PEAK_KEYS)
        out["checkpoint_staging"] = weights[rank] + optim[rank]
        out.update(traffic)
        return out

    by_figures: dict[tuple, int] = {}
    for rank in range(len(optim)):
        by_figures.setdefault(tuple(sorted(figures(rank).items())), rank)
    reps = sorted(by_figures.values())
    largest = max(reps, key=lambda r: (figures(r)["peak"], -r))
    ranks = {r: figures(r) for r in reps if r != largest} if len(reps) > 1 else {}
    return Plan(
        world_size=world_size,
        strategy=strategy.megatron_name
        + (f" + {outer.megatron_name} x{dp_outer}" if dp_outer > 1 else "")
        + (f", tp {tp}" if tp > 1 else ""),
        per_rank=figures(largest),
        ranks=ranks,
        comm=comm.as_dict(),
        comm_by_dim={dim: stats.as_dict() for dim, stats in by_dim.items()},
        options={
            "optimizer": optimizer,
            "dp_outer": str(dp_outer),
            "tp": str(tp),
            **{k: repr(v) for k, v in sorted(options.items())},
        },
    )
