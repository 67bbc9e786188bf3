"""Opt parameters out of sharding, and carry fsdp's parameter attributes across replacement.

``fsdp_no_shard`` keeps chosen parameters replicated on every data-parallel rank under
any strategy: no sharding, no all-gathers, gradients all-reduced. It pays off for small
or frozen sub-modules (a frozen vision encoder in a VLM), whose gathers cost more in
latency and temporary memory than their shards save.

The mark is a Python attribute on the parameter object, so it is lost whenever a
parameter object is replaced (meta-device materialization, wrapping in a new
``nn.Parameter``). :func:`copy_param_attributes` carries it, and the Megatron-Core
attributes fsdp reads, to the replacement.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

import torch
from torch import nn

__all__ = [
    "FSDP_NO_SHARD_ATTR",
    "FSDP_PARAM_ATTRIBUTES",
    "FSDP_WHOLE_ATTR",
    "copy_param_attributes",
    "fsdp_no_shard",
    "fsdp_whole_placement",
    "is_fsdp_no_shard",
    "module_is_fully_no_shard",
]

FSDP_NO_SHARD_ATTR = "_fsdp_no_shard"

FSDP_WHOLE_ATTR = "_fsdp_whole_placement"
"""Set on a parameter whose sharded main weights, gradients and optimizer state one rank
holds whole instead of a row piece on each (Note [whole placement] in ``layout``): what
whole-matrix optimizers (Muon) need. Set by ``fully_shard`` from the optimizer, or by
``fsdp_whole_placement``."""

FSDP_PARAM_ATTRIBUTES: tuple[str, ...] = (
    # fsdp's own marks (this module).
    FSDP_NO_SHARD_ATTR,
    FSDP_WHOLE_ATTR,
    # Megatron-Core tensor parallelism (set_tensor_model_parallel_attributes): whether
    # the tensor is split across TP ranks, along which dim, with which stride.
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    # Megatron-FSDP's adapter for Megatron-Core TP layers, and TE's parallel mode
    # ("column" / "row" / "duplicated"); fsdp_mesh.tensor_parallel reads these.
    "_mcore_tp",
    "_tp_partition_dim",
    "_tp_duplicated",
    "_tensor_parallel_mode",
    # Megatron-Core marks expert (MoE) parameters allreduce=False: they reduce over the
    # expert data-parallel group, not the dense one.
    "allreduce",
    # Replicated across TP ranks but with gradients that must be summed/averaged over TP
    # (layer norms under sequence parallelism; vision towers fed full inputs).
    "sequence_parallel",
    "average_gradients_across_tp_domain",
    # Tied embeddings across pipeline stages; embedding/output marks used by optimizers
    # (e.g. no weight decay) and by bucketing (own bucket for the tied weight).
    "shared",
    "shared_embedding",
    "is_embedding_or_output_parameter",
    "is_embedding_parameter",
)

_T = TypeVar("_T")


def fsdp_no_shard(module_or_param: _T) -> _T:
    """Mark parameters to stay replicated: no sharding, no all-gathers, gradients all-reduced.

    Accepts an ``nn.Module`` (all its parameters, recursively), a single
    ``nn.Parameter``, or an iterable of ``nn.Parameter``. Sets
    ``param._fsdp_no_shard = True`` on each and returns the argument unchanged, so it can
    wrap an expression (``self.vit = fsdp_no_shard(VisionTower(...))``); a one-shot
    iterator (``module.parameters()``) comes back exhausted. Mark before wrapping the
    model: the flag is read when parameters are grouped into buffers.

    Raises ``TypeError`` for anything else, including a plain tensor, before marking
    anything.
    """
    for param in _params_of(module_or_param):
        setattr(param, FSDP_NO_SHARD_ATTR, True)
    return module_or_param


def is_fsdp_no_shard(param: torch.Tensor) -> bool:
    """Whether ``param`` was marked by :func:`fsdp_no_shard`."""
    return bool(getattr(param, FSDP_NO_SHARD_ATTR, False))


def module_is_fully_no_shard(module: nn.Module) -> bool:
    """Whether ``module`` has parameters (recursively) and every one is marked no-shard.

    Such a module never needs an unshard hook, nor do its descendants. A module with no
    parameters returns False: it has nothing to gather either, but that is for the
    caller to decide, not a property of the no-shard mark.
    """
    has_params = False
    for param in module.parameters():
        if not is_fsdp_no_shard(param):
            return False
        has_params = True
    return has_params


def copy_param_attributes(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Copy the :data:`FSDP_PARAM_ATTRIBUTES` present on ``src`` to ``dst``; return ``dst``.

    Also copies ``requires_grad`` when ``dst`` is a leaf, since a new ``nn.Parameter``
    defaults to True and a frozen parameter would silently start training.
    """
    if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor):
        raise TypeError(
            "copy_param_attributes(src, dst) copies attributes between tensors (normally "
            f"nn.Parameter objects), got src={type(src).__name__}, dst={type(dst).__name__}."
        )
    for attr in FSDP_PARAM_ATTRIBUTES:
        if hasattr(src, attr):
            setattr(dst, attr, getattr(src, attr))
    if dst.is_leaf and dst.requires_grad != src.requires_grad:
        dst.requires_grad_(src.requires_grad)
    return dst


def _params_of(obj: object) -> list[nn.Parameter]:
    if isinstance(obj, nn.Module):
        return list(obj.parameters())
    if isinstance(obj, nn.Parameter):
        return [obj]
    if isinstance(obj, torch.Tensor):
        # Checked before the iterable case: a tensor is iterable (over its rows).
        raise TypeError(
            f"fsdp_no_shard got a {type(obj).__name__} that is not an nn.Parameter; it only "
            "marks parameters. Pass the nn.Parameter, or the nn.Module that owns it."
        )
    if isinstance(obj, Iterable) and not isinstance(obj, str | bytes):
        params = list(obj)
        for i, p in enumerate(params):
            if not isinstance(p, nn.Parameter):
                raise TypeError(
                    f"fsdp_no_shard got an iterable whose item {i} is a {type(p).__name__}, "
                    "not an nn.Parameter; pass an nn.Module, an nn.Parameter, or an iterable "
                    "of nn.Parameter (e.g. module.parameters())."
                )
        return params
    raise TypeError(
        f"fsdp_no_shard expects an nn.Module, an nn.Parameter, or an iterable of "
        f"nn.Parameter, got {type(obj).__name__}."
    )


def fsdp_whole_placement(params: Iterable[nn.Parameter]) -> None:
    """Place each of ``params`` (at least 1-d) whole on one rank of its shard group under
    a sharding strategy (Note [whole placement] in ``layout``): for optimizers that step
    whole matrices (Muon). Mark before wrapping."""
    for p in params:
        if not isinstance(p, nn.Parameter) or p.dim() < 1:
            raise ValueError(
                f"fsdp_whole_placement takes parameters with at least one dim; got "
                f"{type(p).__name__} of shape {tuple(getattr(p, 'shape', ()))}"
            )
        setattr(p, FSDP_WHOLE_ATTR, True)
