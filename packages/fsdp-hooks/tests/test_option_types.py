"""Typed options accept only their type, wherever options arrive (Note [option types]
in ``fsdp_hooks.setup.validation``): a boolean given as a string, as it arrives from YAML or a
command line (``calculate_per_token_loss="false"``, which is truthy and would sum the
gradients instead of averaging them), raises a ``TypeError`` naming the option on every
rank, before any collective: from ``fully_shard``, ``fully_shard_model``,
``MegatronFSDP``, ``DistributedDataParallelConfig`` (at construction, and at wrap for
one changed since), and the Megatron-Core adapters (their keywords, ``ddp_config`` and
the transformer config they read). Integers are not booleans and booleans not
integers."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_hooks import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
    MegatronFSDP,
    fully_shard,
    fully_shard_model,
)
from fsdp_mesh import FSDPDistributedIndex
from fsdp_mesh.testing import run_distributed


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))


def _index() -> FSDPDistributedIndex:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    return FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard")


def _changed_config() -> DistributedDataParallelConfig:
    cfg = DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params")
    cfg.average_in_collective = "false"  # changed after construction
    return cfg


def _sgd(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=0.1)


def _cases() -> dict[str, tuple[str, object]]:
    """name -> (the option the error must name, a call)."""
    m = _module
    return {
        "fully_shard": (
            "calculate_per_token_loss",
            lambda: fully_shard(mod := m(), _sgd(mod), calculate_per_token_loss="false"),
        ),
        "fully_shard_decoupled": (
            "use_decoupled_grad",
            lambda: fully_shard(mod := m(), _sgd(mod), use_decoupled_grad="False"),
        ),
        "fully_shard_model": (
            "overlap_grad_reduce",
            lambda: fully_shard_model(m(), overlap_grad_reduce="no"),
        ),
        "int_not_bool": ("prefetch_depth", lambda: fully_shard_model(m(), prefetch_depth=True)),
        "int_not_float": (
            "suggested_communication_unit_size",
            lambda: fully_shard_model(m(), suggested_communication_unit_size=1e5),
        ),
        "MegatronFSDP": (
            "calculate_per_token_loss",
            lambda: MegatronFSDP(m(), _index(), calculate_per_token_loss="false"),
        ),
        "MegatronFSDP_nan": (
            "report_nan_in_param_grad",
            lambda: MegatronFSDP(m(), _index(), report_nan_in_param_grad=1),
        ),
        "ddp_config": (
            "fsdp_double_buffer",
            lambda: DistributedDataParallelConfig(fsdp_double_buffer="true"),
        ),
        "ddp_config_dtype": (
            "megatron_fsdp_main_params_dtype",
            lambda: DistributedDataParallelConfig(megatron_fsdp_main_params_dtype="fp32"),
        ),
        "ddp_config_changed": (
            "average_in_collective",
            lambda: MegatronFSDP(m(), _index(), ddp_config=_changed_config()),
        ),
        "fsdp_adapter_ddp_config": (
            "overlap_grad_reduce",
            lambda: FullyShardedDataParallel(None, {"overlap_grad_reduce": "false"}, m()),
        ),
        "fsdp_adapter_transformer_config": (
            "init_model_with_meta_device",
            lambda: FullyShardedDataParallel(
                SimpleNamespace(init_model_with_meta_device="false"), None, m()
            ),
        ),
        "ddp_adapter_transformer_config": (
            "calculate_per_token_loss",
            lambda: DistributedDataParallel(
                SimpleNamespace(calculate_per_token_loss="false"), None, m()
            ),
        ),
        "ddp_adapter_keyword": (
            "overlap_grad_reduce",
            lambda: DistributedDataParallel(None, None, m(), overlap_grad_reduce="false"),
        ),
        "ddp_adapter_disable_bucketing": (
            "disable_bucketing",
            lambda: DistributedDataParallel(None, None, m(), disable_bucketing="false"),
        ),
    }


def _each_entry_point() -> dict[str, str]:
    got = {}
    for name, (option, call) in _cases().items():
        try:
            call()
            got[name] = "accepted"
        except TypeError as exc:
            got[name] = "ok" if option in str(exc) else f"TypeError not naming {option}: {exc}"
        except Exception as exc:
            got[name] = f"{type(exc).__name__}: {exc}"
    # the right types are still taken (and a device given as a string)
    fully_shard_model(_module(), calculate_per_token_loss=False, prefetch_depth=2, device="cpu")
    DistributedDataParallelConfig(data_parallel_sharding_strategy=3, bucket_size=1000)
    return got


def test_typed_options_refuse_other_types_on_every_rank():
    got = run_distributed(_each_entry_point, 2, timeout=120)
    assert got[0] == got[1], got
    bad = {name: verdict for name, verdict in got[0].items() if verdict != "ok"}
    assert not bad, bad


def test_the_message_says_what_is_allowed():
    try:
        DistributedDataParallelConfig(overlap_grad_reduce="false")
    except TypeError as exc:
        message = str(exc)
    else:
        raise AssertionError("accepted")
    assert message.startswith("DistributedDataParallelConfig: overlap_grad_reduce must be bool")
    assert "got str 'false'" in message and "convert it" in message
