"""What both Megatron-Core style adapters share: reading the configs, and the mesh.

Megatron-Core passes two configs: a transformer config (``config``) and a
``DistributedDataParallelConfig`` (``ddp_config``). Here ``config`` may be any object,
or None: only the attributes listed in ``TRANSFORMER_OPTIONS`` are read from it, with
their Megatron-Core defaults when absent. ``ddp_config`` may be fsdp's
``DistributedDataParallelConfig``, Megatron-Core's own one (or any object with the same
field names), a dict of fields, or None for the defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_hooks.config import DistributedDataParallelConfig
from fsdp_mesh import FSDPDistributedIndex

__all__ = [
    "DP_DIM",
    "TRANSFORMER_OPTIONS",
    "coerce_ddp_config",
    "dist_index_over",
    "hybrid_dist_index",
    "transformer_option",
]

DP_DIM = "dp_shard"
OUTER_DIM = "dp_outer"

# Transformer-config attributes the adapters read, with Megatron-Core's defaults.
TRANSFORMER_OPTIONS: dict[str, Any] = {
    "calculate_per_token_loss": False,
    "init_model_with_meta_device": False,
    "gradient_accumulation_fusion": False,
}


def transformer_option(config: object, name: str) -> Any:
    """``config.<name>``, or Megatron-Core's default when ``config`` is None or lacks it."""
    if name not in TRANSFORMER_OPTIONS:
        raise KeyError(f"{name!r} is not a transformer option the adapters read")
    return getattr(config, name, TRANSFORMER_OPTIONS[name])


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
    return DistributedDataParallelConfig(**values)


def _device_type() -> str:
    backend = dist.get_backend()
    return "cuda" if backend == "nccl" and torch.cuda.is_available() else "cpu"


def dist_index_over(
    group: dist.ProcessGroup | None, who: str, what: str = "data_parallel_group"
) -> FSDPDistributedIndex:
    """An ``FSDPDistributedIndex`` whose shard dim is ``group`` (the whole world when
    None), on CUDA when NCCL is the default backend, else on CPU."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"{who}: torch.distributed is not initialized; call "
            "dist.init_process_group() (or launch with torchrun) first"
        )
    world = dist.get_world_size()
    if group is None or group is dist.group.WORLD:
        mesh = init_device_mesh(_device_type(), (world,), mesh_dim_names=(DP_DIM,))
        return FSDPDistributedIndex(mesh, dp_shard_dim=DP_DIM)
    size = dist.get_world_size(group)
    if size != world:
        raise NotImplementedError(
            f"{who}: {what} has {size} of the {world} ranks; a data-parallel group "
            "smaller than the world (alongside tensor, pipeline or expert parallel groups) "
            "is not implemented yet. Use every rank for data parallelism, or pass None."
        )
    mesh = DeviceMesh.from_group(group, _device_type(), mesh_dim_names=(DP_DIM,))
    return FSDPDistributedIndex(mesh, dp_shard_dim=DP_DIM)


def hybrid_dist_index(instances: int, outer_optim: bool, who: str) -> FSDPDistributedIndex:
    """Megatron-Core's ``num_distributed_optimizer_instances > 1`` over the whole world:
    ``instances`` replicas of a shard group of consecutive ranks (Megatron-Core's
    intra-instance group), i.e. a ``(dp_outer, dp_shard)`` mesh; ``outer_optim`` shards
    main weights and optimizer state across the replicas too (fully-sharded HSDP)."""
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
    mesh = init_device_mesh(
        _device_type(), (instances, world // instances), mesh_dim_names=(OUTER_DIM, DP_DIM)
    )
    return FSDPDistributedIndex(
        mesh, dp_shard_dim=DP_DIM, dp_outer_dim=OUTER_DIM, hsdp_outer_dp_shard=outer_optim
    )
