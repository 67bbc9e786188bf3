"""Parameter names as the model's state dict spells them.

A wrapper may put a prefix in front of ``named_parameters()`` that its ``state_dict()``
does not have (fsdp's ``MegatronFSDP`` and DDP keep the wrapped module as ``module``;
fsdp's wrapper returns the wrapped module's state dict, DDP does not). Names here are
the state dict's keys, so that model and optimizer entries match across wrappers, and
a plain module reads them unchanged.

A wrapper whose ``state_dict()`` renames parameters says so on each renamed parameter:
``_fsdp_state_dict_keys`` = ``{its name in the wrapped module: its state dict key}``
(fsdp's names experts by their global index under expert parallelism). Such keys may
differ across ranks; ``keys_may_differ_across_ranks`` tells, the same on every rank,
so that what must be identical everywhere (param-group name lists) is gathered.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from torch import nn

from fsdp_ckpt.row_shards import (
    PARTITION_ATTR,
    TP_PARTITION_ATTR,
    Entry,
    Partition,
    TensorParallelPart,
)

__all__ = [
    "STATE_KEYS_ATTR",
    "entry_of",
    "keys_may_differ_across_ranks",
    "param_by_state_key",
    "param_fqns",
    "partition_of",
]

_WRAPPER_PREFIX = "module."
STATE_KEYS_ATTR = "_fsdp_state_dict_keys"  # set by fsdp_hooks.features.expert_names


def _state_key(name: str, keys: Collection[str], param: object) -> str | None:
    renamed: dict[str, str] = getattr(param, STATE_KEYS_ATTR, None) or {}
    while True:
        if name in renamed:  # the wrapper's word; the name may be another key's
            return renamed[name] if renamed[name] in keys else None
        if name in keys or not name.startswith(_WRAPPER_PREFIX):
            return name if name in keys else None
        name = name[len(_WRAPPER_PREFIX) :]


def keys_may_differ_across_ranks(params: Iterable[object]) -> bool:
    """Whether some parameter has a key its wrapper chose (fsdp sets it on every rank
    alike, so the answer is the same on every rank)."""
    return any(getattr(p, STATE_KEYS_ATTR, None) for p in params)


def param_by_state_key(model: nn.Module, keys: Collection[str]) -> dict[str, nn.Parameter]:
    """The parameter behind each state dict key that is a parameter (tied parameters
    under every name they have)."""
    out: dict[str, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        key = _state_key(name, keys, p)
        if key is not None:
            out[key] = p
    return out


def param_fqns(model: nn.Module, keys: Collection[str]) -> dict[nn.Parameter, str]:
    """One name per distinct parameter: the first one ``named_parameters()`` gives (as
    a plain module of the same architecture would), in state dict spelling."""
    out: dict[nn.Parameter, str] = {}
    for name, p in model.named_parameters():
        key = _state_key(name, keys, p)
        out[p] = key if key is not None else name
    return out


def partition_of(param: object) -> Partition | None:
    """The fsdp row partition a parameter carries, if any."""
    return getattr(param, PARTITION_ATTR, None)


def entry_of(value: object, param: object) -> Entry:
    """``value`` with the row partition and tensor-parallel part of ``param`` (the
    parameter it is, or has the shape of; None for neither)."""
    return (
        value,
        partition_of(param),
        TensorParallelPart.of(getattr(param, TP_PARTITION_ATTR, None)),
    )
