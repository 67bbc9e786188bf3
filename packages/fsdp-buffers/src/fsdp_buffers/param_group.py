"""Grouping a module's parameters into buckets (one ``ParameterGroup`` per bucket).

Parameters are grouped by FSDP unit × dtype × expert × requires_grad × no_shard, in the
order they first appear in ``module.named_parameters()`` (for most models, forward
order). Parameters outside every FSDP unit are packed into buckets of about
``bucket_size`` elements, or into one bucket per key with ``disable_bucketing``.
A parameter reachable under several names (tied weights) is grouped once, under its
first name; the other names are kept so that state dicts can list them.

Unit coalescing (``communication_unit_size``, Note [communication units]): consecutive
FSDP units, in registration order, are joined into one communication unit until it
holds at least that many parameter elements; the units of one communication unit share
its buckets (one per key), so they are gathered, released and reduced as one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from fsdp_buffers.data_parallel_buffer import DataParallelBuffer
from fsdp_buffers.no_shard import is_fsdp_no_shard

# Megatron-Core's DDP default: buckets of 40M elements.
DEFAULT_BUCKET_SIZE = 40_000_000
# Unit coalescing's default (``suggested_communication_unit_size=None``, as
# Megatron-FSDP's None, means "choose"): units smaller than 65,536 elements are gathered
# and reduced in pairs (docs/benchmarks.md, "coalescing by default"). It joins nothing
# at or above that size, so no transformer block of a real model. Pairs halve the
# collectives of a model of small units; larger groups cost peak memory in proportion
# (measured above FSDP2's) for less and less time, so the default stops at two.
DEFAULT_COMMUNICATION_UNIT_SIZE = 65_536
DEFAULT_COMMUNICATION_UNIT_MAX_UNITS = 2
# Below ZeRO-3 nothing stays gathered: a group's bucket exists only as transient
# communication buffers (its weight all-gather's rank-major copy, its gradient staging),
# so the default joins more: groups of at least 131,072 elements, of at most four units.
REPLICATED_COMMUNICATION_UNIT_SIZE = 131_072
REPLICATED_COMMUNICATION_UNIT_MAX_UNITS = 4

UnitSpec = type[nn.Module] | str


@dataclass(eq=False)
class ParameterGroup:
    """A bucket: parameters that share a flat buffer and move together.

    ``fsdp_unit_id`` is the index of the FSDP unit the parameters belong to, or None for
    parameters outside every unit; with unit coalescing, the first unit of the
    communication unit, and ``coalesced_unit_ids`` every unit of it (``(fsdp_unit_id,)``
    without coalescing, ``()`` outside units). ``chunk_size_factor`` is Megatron-FSDP's
    field, always 1 here: the shard layout's alignment does its job. The buffers are filled in by ``ParamAndGradBuffer``
    according to the sharding strategy; a buffer that the strategy does not need is None:
    ``transpose_weight_buffer`` is for FP8 weights' transposes (none yet), ``hsdp_gbuf``
    the gradients of main weights sharded over the outer dim too (fully-sharded hybrid).
    """

    params: list[nn.Parameter]
    dtype: torch.dtype
    is_expert_param: bool = False
    requires_grad: bool = True
    fsdp_unit_id: int | None = None
    fsdp_no_shard: bool = False
    coalesced_unit_ids: tuple[int, ...] = ()
    chunk_size_factor: int = 1
    names: list[str] = field(default_factory=list)
    model_weight_buffer: DataParallelBuffer | None = None
    transpose_weight_buffer: DataParallelBuffer | None = None
    main_weight_buffer: DataParallelBuffer | None = None
    main_grad_buffer: DataParallelBuffer | None = None
    hsdp_gbuf: DataParallelBuffer | None = None

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point


def resolve_unit_classes(
    unit_modules: Iterable[UnitSpec] | None, module: nn.Module
) -> tuple[type[nn.Module], ...]:
    """Turn classes or dotted class paths into classes; a spec matching no submodule of
    ``module`` is an error that lists the module types present."""
    classes: list[type[nn.Module]] = []
    for spec in unit_modules or ():
        if isinstance(spec, str):
            classes.append(_import_class(spec))
        elif isinstance(spec, type) and issubclass(spec, nn.Module):
            classes.append(spec)
        else:
            raise TypeError(
                f"fsdp_unit_modules entries must be nn.Module subclasses or dotted class "
                f"paths such as 'mypkg.model.Block'; got {spec!r}"
            )
    present = {type(m) for m in module.modules()}
    for cls in classes:
        if not any(issubclass(t, cls) for t in present):
            names = sorted({f"{t.__module__}.{t.__qualname__}" for t in present})
            raise ValueError(
                f"FSDP unit class {cls.__module__}.{cls.__qualname__} matches no submodule "
                f"of the model; module types present: {names}"
            )
    return tuple(classes)


def _import_class(path: str) -> type[nn.Module]:
    module_name, _, class_name = path.rpartition(".")
    if not module_name:
        raise ValueError(
            f"fsdp_unit_modules string {path!r} must be a dotted path 'package.module.Class'"
        )
    try:
        obj = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import FSDP unit class {path!r}: {e}") from e
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise TypeError(f"FSDP unit {path!r} is {obj!r}, not an nn.Module subclass")
    return obj


def find_fsdp_units(module: nn.Module, unit_classes: Sequence[type[nn.Module]]) -> list[str]:
    """Names of the FSDP unit modules, outermost only, in ``named_modules`` order."""
    units: list[str] = []
    if not unit_classes:
        return units
    for name, sub in module.named_modules():
        if not isinstance(sub, tuple(unit_classes)):
            continue
        if "" in units or any(name.startswith(u + ".") for u in units):
            continue  # inside an outer unit, which owns its parameters
        units.append(name)
    return units


def _unit_of(param_name: str, units: Sequence[str]) -> int | None:
    for i, unit in enumerate(units):
        if unit == "" or param_name.startswith(unit + "."):
            return i
    return None


def coalesce_units(
    unit_numels: Sequence[int],
    communication_unit_size: int | None,
    max_units: int | None = None,
) -> list[int]:
    """Note [communication units]: the communication unit of each FSDP unit. Units are
    taken in registration order (``named_modules`` order: the execution order of a
    sequential model) and joined to the open communication unit until it holds at least
    ``communication_unit_size`` elements, or ``max_units`` units; then the next unit
    opens a new one. ``None`` (or 0) keeps one unit per communication unit (the
    wrappers' default is :func:`resolve_communication_units`'). A unit bigger than the
    size is alone. Returns, for each unit, the index of the first unit of its
    communication unit."""
    if max_units is not None and (
        isinstance(max_units, bool) or not isinstance(max_units, int) or max_units < 1
    ):
        raise ValueError(f"max_units must be a positive number of units or None; got {max_units!r}")
    if communication_unit_size is not None and (
        isinstance(communication_unit_size, bool)
        or not isinstance(communication_unit_size, int)
        or communication_unit_size < 0
    ):
        raise ValueError(
            "communication_unit_size (suggested_communication_unit_size) must be a "
            f"non-negative number of elements or None; got {communication_unit_size!r}"
        )
    out: list[int] = []
    first, held = 0, 0
    for i, numel in enumerate(unit_numels):
        full = max_units is not None and i - first >= max_units
        if not out or held >= (communication_unit_size or 0) or full:
            first, held = i, 0
        out.append(first)
        held += numel
    return out


def resolve_communication_units(
    suggested: int | None, shards_model_weights: bool = True
) -> tuple[int, int | None]:
    """``suggested_communication_unit_size`` as the wrappers apply it, as (size, most
    units per communication unit): ``None`` (as in Megatron-FSDP, "choose for me") is
    ``DEFAULT_COMMUNICATION_UNIT_SIZE`` in groups of at most
    ``DEFAULT_COMMUNICATION_UNIT_MAX_UNITS`` under ZeRO-3 (``shards_model_weights``),
    and the ``REPLICATED_`` pair below it; a number is that size with no cap on units;
    0 is no coalescing."""
    if suggested is None:
        if shards_model_weights:
            return DEFAULT_COMMUNICATION_UNIT_SIZE, DEFAULT_COMMUNICATION_UNIT_MAX_UNITS
        return REPLICATED_COMMUNICATION_UNIT_SIZE, REPLICATED_COMMUNICATION_UNIT_MAX_UNITS
    return suggested, None


def group_parameters(
    module: nn.Module,
    unit_classes: Sequence[type[nn.Module]] = (),
    *,
    bucket_size: int | None = None,
    disable_bucketing: bool = False,
    is_expert_param: Callable[[str, nn.Parameter], bool] | None = None,
    communication_unit_size: int | None = None,
    communication_unit_max_units: int | None = None,
) -> tuple[list[ParameterGroup], list[str]]:
    """Group ``module``'s parameters; returns the groups and the FSDP unit names.

    Non-float parameters (integer buffers registered as parameters) are kept
    replicated: they are grouped as ``fsdp_no_shard`` with ``requires_grad=False``.
    0-d parameters (a learnable scale) are grouped as ``fsdp_no_shard`` too: a DTensor
    cannot be ``Shard(0)`` of a scalar, and replicating one element costs nothing.
    """
    if bucket_size is not None and bucket_size < 1:
        raise ValueError(f"bucket_size must be a positive number of elements; got {bucket_size}")
    target = DEFAULT_BUCKET_SIZE if bucket_size is None else bucket_size
    units = find_fsdp_units(module, unit_classes)
    named = list(module.named_parameters())
    unit_of = [_unit_of(name, units) for name, _p in named]  # once per parameter
    unit_numels = [0] * len(units)
    for (_name, p), u in zip(named, unit_of, strict=True):
        if u is not None:
            unit_numels[u] += p.numel()
    comm_unit = coalesce_units(unit_numels, communication_unit_size, communication_unit_max_units)
    members: dict[int, tuple[int, ...]] = {}
    for u, first in enumerate(comm_unit):
        members[first] = (*members.get(first, ()), u)

    groups: list[ParameterGroup] = []
    open_groups: dict[tuple, ParameterGroup] = {}
    for (name, p), unit_id in zip(named, unit_of, strict=True):
        is_float = p.dtype.is_floating_point or p.dtype.is_complex
        if unit_id is not None:
            unit_id = comm_unit[unit_id]
        expert = bool(is_expert_param(name, p)) if is_expert_param else False
        requires_grad = p.requires_grad and is_float
        no_shard = is_fsdp_no_shard(p) or not is_float or p.dim() == 0
        key = (unit_id, p.dtype, expert, requires_grad, no_shard)
        group = open_groups.get(key)
        bucket_full = group is not None and group.numel + p.numel() > target
        if bucket_full and unit_id is None and not disable_bucketing:
            group = None  # start a new bucket for this key
        if group is None:
            group = ParameterGroup(
                params=[],
                dtype=p.dtype,
                is_expert_param=expert,
                requires_grad=requires_grad,
                fsdp_unit_id=unit_id,
                fsdp_no_shard=no_shard,
                coalesced_unit_ids=members[unit_id] if unit_id is not None else (),
            )
            groups.append(group)
            open_groups[key] = group
        group.params.append(p)
        group.names.append(name)
    return groups, units


def tied_parameter_names(module: nn.Module) -> dict[str, list[str]]:
    """Primary name -> every other name under which the same parameter is reachable."""
    seen: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        primary = seen.setdefault(id(p), name)
        if primary != name:
            aliases.setdefault(primary, []).append(name)
    return aliases
