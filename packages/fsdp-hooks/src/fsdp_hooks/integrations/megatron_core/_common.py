"""What both Megatron-Core style adapters share: reading the configs, and the mesh.

Megatron-Core passes two configs: a transformer config (``config``) and a
``DistributedDataParallelConfig`` (``ddp_config``). Here ``config`` may be any object,
or None: only the attributes listed in ``TRANSFORMER_OPTIONS`` are read from it, with
their Megatron-Core defaults when absent. ``ddp_config`` may be fsdp's
``DistributedDataParallelConfig``, Megatron-Core's own one (or any object with the same
field names), a dict of fields, or None for the defaults.

Megatron-Core's config has fields fsdp does not know (``check_for_large_grads``,
``align_param_gather``, ...). They are accepted and ignored; those set to something
other than their default (and truthy: a user asked for a feature) are named in one
warning, so that nobody believes a feature is on when it is not. A dict with an
unknown key is an error instead: it was written for fsdp, so the key is a typo.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_hooks.module.config import DistributedDataParallelConfig
from fsdp_hooks.setup.validation import check_option_types
from fsdp_mesh import FSDPDistributedIndex, default_device_type

__all__ = [
    "DP_DIM",
    "TRANSFORMER_OPTIONS",
    "GradBufferList",
    "coerce_ddp_config",
    "dist_index_over",
    "hybrid_dist_index",
    "index_from_pg_collection",
    "set_is_first_microbatch",
    "transformer_option",
]

DP_DIM = "dp_shard"
OUTER_DIM = "dp_outer"

# Transformer-config attributes the adapters read, with Megatron-Core's defaults.
TRANSFORMER_OPTIONS: dict[str, Any] = {
    "calculate_per_token_loss": False,
    "init_model_with_meta_device": False,
    "gradient_accumulation_fusion": False,
    "fp8": None,
    "fp4": None,
    "use_kitchen": False,
    "quant_recipe": None,
    "num_moe_experts": None,
}


# Their types where checkable (the booleans): Note [option types] in fsdp_hooks.setup.validation.
_TRANSFORMER_OPTION_TYPES = {
    name: (bool,) for name, default in TRANSFORMER_OPTIONS.items() if isinstance(default, bool)
}


def transformer_option(config: object, name: str) -> Any:
    """``config.<name>``, or Megatron-Core's default when ``config`` is None or lacks it;
    a boolean option that is not a ``bool`` raises ``TypeError`` naming it."""
    if name not in TRANSFORMER_OPTIONS:
        raise KeyError(f"{name!r} is not a transformer option the adapters read")
    value = getattr(config, name, TRANSFORMER_OPTIONS[name])
    check_option_types("the transformer config", _TRANSFORMER_OPTION_TYPES, {name: value})
    return value


_FIELDS = tuple(f.name for f in dataclasses.fields(DistributedDataParallelConfig))


def coerce_ddp_config(ddp_config: object, who: str) -> DistributedDataParallelConfig:
    """fsdp's ``DistributedDataParallelConfig`` from what the caller gave (a copy, so
    that adapter overrides never change the caller's object)."""
    if ddp_config is None:
        return DistributedDataParallelConfig()
    if isinstance(ddp_config, DistributedDataParallelConfig):
        return dataclasses.replace(ddp_config)
    if isinstance(ddp_config, nn.Module):
        raise TypeError(
            f"{who}: ddp_config is an nn.Module ({type(ddp_config).__name__}); the signature "
            f"is {who}(config, ddp_config, module, ...), as in Megatron-Core. Pass the "
            "module as the third argument (or module=...) and a DistributedDataParallelConfig "
            "(or None) as ddp_config."
        )
    if isinstance(ddp_config, Mapping):
        unknown = sorted(set(ddp_config) - set(_FIELDS))
        if unknown:
            raise ValueError(
                f"{who}: unknown ddp_config fields {unknown}; the fields are {list(_FIELDS)}"
            )
        return DistributedDataParallelConfig(**ddp_config)
    # Megatron-Core's own config, or any object with the same field names.
    values = {name: getattr(ddp_config, name) for name in _FIELDS if hasattr(ddp_config, name)}
    if not values:
        raise TypeError(
            f"{who}: ddp_config must be a DistributedDataParallelConfig (fsdp's or "
            f"Megatron-Core's), a dict of its fields, or None; got {type(ddp_config).__name__}"
        )
    ignored = _unknown_fields_set(ddp_config)
    if ignored:
        warnings.warn(
            f"{who}: ddp_config ({type(ddp_config).__name__}) sets fields fsdp does not "
            f"implement: {', '.join(f'{k}={v!r}' for k, v in ignored.items())}; accepted "
            "and ignored",
            UserWarning,
            stacklevel=2,
        )
    return DistributedDataParallelConfig(**values)


def _field_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _unknown_fields_set(ddp_config: object) -> dict[str, Any]:
    """The fields of ``ddp_config`` fsdp does not know whose value is truthy and not
    the field's default (a dataclass's declared default; for other objects, any truthy
    public attribute counts), in declaration order."""
    if dataclasses.is_dataclass(ddp_config):
        candidates = {f.name: _field_default(f) for f in dataclasses.fields(ddp_config)}
    else:
        attrs = getattr(ddp_config, "__dict__", {})
        candidates = {k: dataclasses.MISSING for k in attrs if not k.startswith("_")}
    out: dict[str, Any] = {}
    for name, default in candidates.items():
        if name in _FIELDS or not hasattr(ddp_config, name):
            continue
        value = getattr(ddp_config, name)
        if callable(value):
            continue
        try:
            is_default = default is not dataclasses.MISSING and bool(value == default)
            set_to_something = bool(value)
        except Exception:  # e.g. a tensor of several elements: it was set on purpose
            is_default, set_to_something = False, True
        if set_to_something and not is_default:
            out[name] = value
    return out


def dist_index_over(
    group: dist.ProcessGroup | None,
    who: str,
    what: str = "data_parallel_group",
    *,
    expert_group: dist.ProcessGroup | None = None,
    experts: bool = False,
) -> FSDPDistributedIndex:
    """An ``FSDPDistributedIndex`` whose shard dim is ``group`` (the whole world when
    None), on CUDA when NCCL is the default backend, else on CPU. ``group`` may be a
    part of the world (Megatron-Core's data-parallel group beside tensor and pipeline
    groups): each rank passes its own, and collectives stay inside it.

    ``experts`` (a MoE model: Megatron-Core's ``config.num_moe_experts``) gives the index
    an expert mesh, as Megatron-Core's adapter builds one from its parallel state: over
    ``expert_group`` (the expert data-parallel group) when given, else over the same
    ranks as the dense one (expert parallelism of one rank)."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"{who}: torch.distributed is not initialized; call "
            "dist.init_process_group() (or launch with torchrun) first"
        )
    world = dist.get_world_size()
    device = default_device_type()
    if group is None or group is dist.group.WORLD:
        mesh = init_device_mesh(device, (world,), mesh_dim_names=(DP_DIM,))
        # A root mesh of its own: the expert groups are the experts', as in Megatron-Core.
        expt = init_device_mesh(device, (world,), mesh_dim_names=(DP_DIM,)) if experts else None
        return FSDPDistributedIndex(mesh, dp_shard_dim=DP_DIM, expt_device_mesh=expt)
    for given, name in ((group, what), (expert_group, "expert data-parallel group")):
        if given is not None and dist.get_rank(given) < 0:
            raise ValueError(
                f"{who}: this rank ({dist.get_rank()}) is not in the {name} it was given; "
                "pass the group this rank belongs to (each rank passes its own)"
            )
    mesh = DeviceMesh.from_group(group, device, mesh_dim_names=(DP_DIM,))
    expt = None
    if experts:
        expt = DeviceMesh.from_group(expert_group or group, device, mesh_dim_names=(DP_DIM,))
    return FSDPDistributedIndex(
        mesh, dp_shard_dim=DP_DIM, part_of_world=True, expt_device_mesh=expt
    )


def hybrid_dist_index(
    instances: int, outer_optim: bool, who: str, *, experts: bool = False
) -> FSDPDistributedIndex:
    """Megatron-Core's ``num_distributed_optimizer_instances > 1`` over the whole world:
    ``instances`` replicas of a shard group of consecutive ranks (Megatron-Core's
    intra-instance group), i.e. a ``(dp_outer, dp_shard)`` mesh; ``outer_optim`` shards
    main weights and optimizer state across the replicas too (fully-sharded HSDP).
    ``experts``: an expert mesh of the same layout (``dist_index_over``)."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"{who}: torch.distributed is not initialized; call "
            "dist.init_process_group() (or launch with torchrun) first"
        )
    world = dist.get_world_size()
    if world % instances != 0:
        raise ValueError(
            f"{who}: num_distributed_optimizer_instances={instances} does not divide the "
            f"{world} data-parallel ranks; use a divisor of {world}"
        )
    shape, names = (instances, world // instances), (OUTER_DIM, DP_DIM)
    mesh = init_device_mesh(default_device_type(), shape, mesh_dim_names=names)
    expt = init_device_mesh(default_device_type(), shape, mesh_dim_names=names) if experts else None
    return FSDPDistributedIndex(
        mesh,
        dp_shard_dim=DP_DIM,
        dp_outer_dim=OUTER_DIM,
        hsdp_outer_dp_shard=outer_optim,
        expt_device_mesh=expt,
    )


def index_from_pg_collection(
    pg_collection: Any, who: str, *, experts: bool = False
) -> FSDPDistributedIndex:
    """The data-parallel index over Megatron-Core's ``pg_collection.dp_cp`` (or ``dp``)
    group. Tensor, expert, pipeline and context groups of more than one rank are
    refused: only data parallelism is read from a pg_collection. ``experts``: the
    expert mesh over ``pg_collection.expt_dp`` (or the data-parallel group)."""
    for name in ("tp", "ep", "pp", "cp", "expt_tp"):
        group = getattr(pg_collection, name, None)
        if group is not None and dist.get_world_size(group) > 1:
            raise NotImplementedError(
                f"{who}: pg_collection.{name} has {dist.get_world_size(group)} ranks; "
                "tensor, pipeline, context and expert parallel groups from a pg_collection "
                "are not implemented yet (only data parallelism is). For tensor parallelism "
                "pass dist_index= (an FSDPDistributedIndex over a (dp_shard, tp) mesh with "
                "tp_dim) to FullyShardedDataParallel instead"
            )
    group = getattr(pg_collection, "dp_cp", None) or getattr(pg_collection, "dp", None)
    expert_group = getattr(pg_collection, "expt_dp", None)
    return dist_index_over(
        group, who, "pg_collection.dp_cp", expert_group=expert_group, experts=experts
    )


def set_is_first_microbatch(wrapper: nn.Module, config: object) -> None:
    """Megatron-Core's ``MegatronModule.set_is_first_microbatch``: when the transformer
    config quantizes weights (``fp8``, ``fp4``, ``use_kitchen`` or ``quant_recipe``
    set), set ``is_first_microbatch = True`` on every submodule that has that attribute
    (Transformer Engine layers then refresh their cached quantized weights); otherwise
    nothing."""
    quantized = (
        transformer_option(config, "fp8") is not None
        or transformer_option(config, "fp4") is not None
        or bool(transformer_option(config, "use_kitchen"))
        or transformer_option(config, "quant_recipe") is not None
    )
    if not quantized:
        return
    for m in wrapper.modules():
        if hasattr(m, "is_first_microbatch"):
            m.is_first_microbatch = True


class GradBufferList(list):
    """Megatron-Core's ``model.buffers``: a list of the model's gradient buffers (what
    Megatron-Core's optimizer factory and training loop read; there the attribute
    shadows ``nn.Module.buffers``). This list is also callable, as
    ``nn.Module.buffers(recurse=True)`` of its owner, so that torch code calling
    ``model.buffers()`` still iterates the module's registered buffers."""

    def __init__(self, owner: nn.Module, items: Iterator[Any] | list[Any]) -> None:
        super().__init__(items)
        self._owner = weakref.ref(owner)

    def __call__(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        owner = self._owner()
        if owner is None:
            raise RuntimeError("the module owning these buffers no longer exists")
        return nn.Module.buffers(owner, recurse=recurse)
