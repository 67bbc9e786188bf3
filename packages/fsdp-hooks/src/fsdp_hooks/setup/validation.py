"""Checks at wrap time that turn bad input into a clear error on every rank."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import numbers
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_buffers import MixedPrecisionPolicy, ShardingStrategy
from fsdp_buffers.tensor_parallel import TensorParallel, TPKind
from fsdp_mesh import current_device

__all__ = [
    "broadcast_from_dp_rank0",
    "check_argument_types",
    "check_hybrid_index",
    "check_no_meta_params",
    "check_not_wrapped",
    "check_option_types",
    "check_outer_strategy",
    "check_param_dtype",
    "check_same_model",
    "check_tensor_parallel_replicas",
    "describe_option",
    "digest",
    "gather_ints",
]

logger = logging.getLogger("fsdp_hooks")


def _show(value: object) -> str:
    return f"{type(value).__name__} {value!r:.60}"


def check_argument_types(
    where: str,
    module: object,
    fsdp_unit_modules: object = None,
    **optional: tuple[object, type, str],
) -> None:
    """Raise ``TypeError`` naming what is allowed for an argument of the wrong kind,
    before anything is touched (rather than an AttributeError deep inside, or a string
    iterated by character). ``optional``: name -> (value, allowed type, example); None
    is allowed. Local information only: alike on every rank."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"{where}: the module to shard must be a torch.nn.Module; got {_show(module)}"
        )
    units = fsdp_unit_modules
    allowed = (
        "fsdp_unit_modules must be a list of nn.Module subclasses or dotted class paths, "
        "e.g. [TransformerBlock] or ['mypkg.model.TransformerBlock'] (or None)"
    )
    if isinstance(units, type):
        raise TypeError(
            f"{where}: {allowed}; got the class {units.__qualname__} itself: pass "
            f"[{units.__qualname__}] (as Megatron-FSDP, a single class is not accepted)"
        )
    if isinstance(units, str | bytes):
        raise TypeError(
            f"{where}: {allowed}; got the string {units!r}, which would be read letter by "
            f"letter: pass [{units!r}]"
        )
    if units is not None and (isinstance(units, Mapping) or not isinstance(units, Iterable)):
        raise TypeError(f"{where}: {allowed}; got {_show(units)}")
    for name, (value, kind, example) in optional.items():
        if value is not None and not isinstance(value, kind):
            raise TypeError(
                f"{where}: {name} must be a {kind.__module__}.{kind.__qualname__} (e.g. "
                f"{example}) or None; got {_show(value)}"
            )


# Note [option types]
# Options arrive from YAML files and command lines as strings: ``"false"`` is truthy,
# so a boolean option given as one would silently mean True (a per-token loss summed
# instead of averaged). Every typed option is checked against its annotation, in one
# place (``check_option_types``), wherever options arrive: ``fully_shard`` and
# ``fully_shard_model``'s keywords, ``MegatronFSDP``'s, every field of a
# ``DistributedDataParallelConfig`` (fsdp's at construction; any ddp_config again at
# wrap, Megatron-Core's or one changed after construction), the adapters' keywords and
# the transformer-config options they read. ``bool`` accepts only ``bool``; ``int``
# any integer but ``bool``; ``float`` any real number but ``bool``; classes (``str``,
# ``torch.dtype``, ``DeviceMesh``, ...) their instances. Annotations this cannot check
# (callables, containers of classes) are left to the specific checks. The check is
# local and deterministic (the same arguments give the same verdict on every rank), so
# raising before any collective raises on every rank.


def _checkable(hint: Any) -> tuple[type, ...] | None:
    """The classes an annotation allows, or None when it is not a union of plain
    classes (then it is not checked here)."""
    if hint is None or hint is type(None):
        return (type(None),)
    if hint is Any:  # a class since Python 3.11, but not one for isinstance
        return None
    if isinstance(hint, type) and not isinstance(hint, types.GenericAlias):
        return (hint,)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        out: list[type] = []
        for arg in typing.get_args(hint):
            allowed = _checkable(arg)
            if allowed is None:
                return None
            out.extend(allowed)
        return tuple(out)
    return None


def _allows(value: object, allowed: tuple[type, ...]) -> bool:
    for kind in allowed:
        if kind is bool:
            if isinstance(value, bool):
                return True
        elif kind is int:
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                return True
        elif kind is float:
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                return True
        elif isinstance(value, kind):
            return True
    return False


def _kind_name(kind: type) -> str:
    if kind is type(None):
        return "None"
    module = "" if kind.__module__ == "builtins" else f"{kind.__module__}."
    return f"{module}{kind.__qualname__}"


@functools.cache
def _option_types(owner: Callable[..., Any] | type) -> dict[str, tuple[type, ...]]:
    """The checkable annotations of a function's parameters or a dataclass's fields."""
    hints = typing.get_type_hints(owner)
    hints.pop("return", None)
    checkable = {name: _checkable(hint) for name, hint in hints.items()}
    return {name: allowed for name, allowed in checkable.items() if allowed is not None}


def check_option_types(
    where: str,
    owner: Callable[..., Any] | type | Mapping[str, tuple[type, ...]],
    values: Mapping[str, Any],
) -> None:
    """Raise ``TypeError`` naming the option, what it got and what is allowed, for the
    first of ``values`` whose type its annotation in ``owner`` (a function, a dataclass,
    or a mapping of names to allowed classes) does not allow (see Note [option types]).
    Names without a checkable annotation are skipped."""
    allowed_by_name = owner if isinstance(owner, Mapping) else _option_types(owner)
    for name, value in values.items():
        allowed = allowed_by_name.get(name)
        if allowed is None or _allows(value, allowed):
            continue
        kinds = " or ".join(_kind_name(k) for k in allowed)
        hint = ""
        if bool in allowed and isinstance(value, str):
            hint = (
                " (a string such as 'false' from a config file or command line is true: convert it)"
            )
        raise TypeError(f"{where}: {name} must be {kinds}; got {_show(value)}{hint}")


def check_outer_strategy(
    strategy,
    outer,
    has_outer_dim: bool,
    where: str,
    add_outer_dim: str = "pass dp_outer_dim (a dim of device_mesh)",
) -> None:
    """Megatron-FSDP's rules for ``outer_dp_sharding_strategy`` (``ShardingStrategy``
    values): ``no_shard`` (replicate across the outer dim, HSDP) or ``optim`` (shard
    main weights and optimizer state across it too), the latter only over an outer dim
    (``add_outer_dim`` says how to get one) and with ``optim_grads_params`` inside.
    Local information only: same on every rank. Every entry point checks with this."""
    if outer not in (ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM):
        raise ValueError(
            f"{where}: outer_dp_sharding_strategy={outer.megatron_name!r} is not supported "
            "across the outer (replica) data-parallel dim; allowed: 'no_shard', 'optim' "
            "(replicate across it, HSDP; or also shard main weights and optimizer state "
            "across it, fully-sharded HSDP)."
        )
    if outer is ShardingStrategy.OPTIM and not has_outer_dim:
        raise ValueError(
            f"{where}: outer_dp_sharding_strategy='optim' shards across the outer "
            f"data-parallel dim, but no outer dim was given; {add_outer_dim} or use "
            "outer_dp_sharding_strategy='no_shard'."
        )
    if outer is ShardingStrategy.OPTIM and strategy is not ShardingStrategy.OPTIM_GRADS_PARAMS:
        raise ValueError(
            f"{where}: outer_dp_sharding_strategy='optim' (fully-sharded HSDP) requires "
            "data_parallel_sharding_strategy (zero_dp_strategy) 'optim_grads_params' (3); "
            f"got {strategy.megatron_name!r}."
        )


def check_hybrid_index(dist_index, strategy, outer, init_model_with_meta_device: bool) -> None:
    """The wrapper's strategies against its ``FSDPDistributedIndex``, and the mesh
    features not implemented yet (a clear error rather than a wrong result)."""
    check_outer_strategy(strategy, outer, dist_index.use_hybrid_fsdp, "MegatronFSDP")
    wants = outer is ShardingStrategy.OPTIM
    if wants != dist_index.hsdp_outer_dp_shard:
        raise ValueError(
            f"MegatronFSDP: ddp_config.outer_dp_sharding_strategy={outer.megatron_name!r} "
            f"but the FSDPDistributedIndex has hsdp_outer_dp_shard="
            f"{dist_index.hsdp_outer_dp_shard}; build the index with hsdp_outer_dp_shard="
            f"{wants} (True exactly when the outer strategy is 'optim')."
        )
    tp = dist_index.tp_size > 1 or dist_index.expt_tp_size > 1
    if tp and dist_index.has_expert_mesh:
        raise NotImplementedError(
            f"tensor parallelism (tp_dim={dist_index.tp_dim!r} of {dist_index.tp_size} "
            "ranks) together with an expert-parallel mesh (expt_device_mesh) is not "
            "implemented in fsdp: expert parameters would need their own (expert dp, "
            "expert tp) DTensor views and groups. Use expert parallelism without tensor "
            "parallelism (tp of 1), or tensor parallelism without expt_device_mesh (expert "
            "parameters are then sharded like dense ones)."
        )


def check_no_meta_params(module: nn.Module, where: str, remedy: str) -> None:
    """Refuse a module with parameters on the meta device, naming them, before anything
    touches it (``module.to(device)`` would fail on them without saying why)."""
    names = [n for n, p in module.named_parameters() if p.device.type == "meta"]
    if names:
        raise ValueError(
            f"{where}: parameters {names[:5]}{' ...' if len(names) > 5 else ''} are on the "
            f"meta device; {remedy}"
        )


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


def _fingerprint(module: nn.Module) -> list[tuple[str, tuple[int, ...], str, bool]]:
    return [
        (name, tuple(p.shape), str(p.dtype), p.requires_grad)
        for name, p in module.named_parameters()
    ]


def describe_option(value: Any) -> str:
    """A rank-independent text for an option's value: classes and functions by their
    qualified name (their repr holds an address), containers item by item."""
    if isinstance(value, type) or (callable(value) and hasattr(value, "__qualname__")):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [describe_option(v) for v in value]
        return (
            "[" + ", ".join(sorted(items) if isinstance(value, (set, frozenset)) else items) + "]"
        )
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = (
            f"{f.name}={describe_option(getattr(value, f.name))}" for f in dataclasses.fields(value)
        )
        return f"{type(value).__name__}(" + ", ".join(fields) + ")"
    text = repr(value)
    # Objects without a repr of their own (generators, ...) show an address.
    return f"<{type(value).__qualname__}>" if " at 0x" in text else text


def _value_checksums(
    module: nn.Module, skip: Callable[[str, nn.Parameter], bool] | None
) -> tuple[list[str], torch.Tensor | None]:
    """float64 sum and sum of squares of each parameter's (local) values, on its device;
    meta parameters and those ``skip`` names (experts that differ across ranks) left out."""
    names, sums = [], []
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.device.type == "meta" or (skip is not None and skip(name, p)):
                continue
            local = p.to_local() if isinstance(p, DTensor) else p
            local = local.detach().double()
            names.append(name)
            sums.append(torch.stack([local.sum(), local.square().sum()]))
    return names, (torch.stack(sums).cpu() if sums else None)


def digest(data: bytes) -> int:
    """A 56-bit digest of ``data``: fits in an int64 for ``gather_ints``."""
    return int.from_bytes(hashlib.sha256(data).digest()[:7], "little")


def gather_ints(
    values: Sequence[int], group: dist.ProcessGroup, device_type: str
) -> list[list[int]]:
    """Every rank's ``values`` (the same count on each), in ``group`` rank order: one
    all-gather of int64s on the group's device. The check-across-ranks primitive: hash
    locally (``digest``), compare here, gather details only when something differs."""
    mine = torch.tensor(list(values), dtype=torch.int64, device=current_device(device_type))
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [t.tolist() for t in everyone]


def check_same_model(
    module: nn.Module,
    dist_index,
    options: Mapping[str, Any] | None = None,
    *,
    skip_values: Callable[[str, nn.Parameter], bool] | None = None,
    check_values: bool = True,
) -> list[str]:
    """Every data-parallel rank must wrap the same model with the same options: compare
    a fingerprint of parameter names, shapes, dtypes and requires_grad, of the wrapping
    ``options`` (strategy, units, mixed precision, ...) and of the parameters' initial
    values, so that a mismatch raises here, on every rank and naming what differs,
    instead of hanging in a collective or training different replicas. One all-gather
    of two integers; details are gathered only when something differs.

    Initial values (``check_values``): the names of the parameters whose values differ
    from data-parallel rank 0's are returned (the same list on every rank), for the
    caller to broadcast rank 0's as torch DDP does; ``skip_values`` names parameters that
    may differ (experts of an expert-parallel mesh)."""
    if not dist.is_initialized():
        return []
    group = dist_index.get_dp_group()
    entries = _fingerprint(module)
    described = {k: describe_option(v) for k, v in (options or {}).items()}
    value_names, checksums = _value_checksums(module, skip_values) if check_values else ([], None)
    structure = digest(repr((entries, sorted(described.items()))).encode())
    values = digest(
        repr(value_names).encode() + (checksums.numpy().tobytes() if checksums is not None else b"")
    )
    everyone = gather_ints([structure, values], group, dist_index.device_type)
    if all(row == everyone[0] for row in everyone):
        return []
    summaries: list[Any] = [None] * dist.get_world_size(group)
    mine_details = (dist.get_rank(), entries, described, value_names, checksums)
    dist.all_gather_object(summaries, mine_details, group=group)
    reference_rank, reference, ref_options, ref_names, ref_sums = summaries[0]
    problems = []
    for rank, other, *_ in summaries[1:]:
        if other != reference:
            diff = next(
                (f"{a} vs {b}" for a, b in zip(reference, other, strict=False) if a != b),
                f"{len(reference)} parameters vs {len(other)}",
            )
            problems.append(f"rank {rank} differs from rank {reference_rank}: {diff}")
    if problems:
        raise ValueError(
            "the model differs across data-parallel ranks (parameter name, shape, dtype or "
            "requires_grad); every rank must build the same model before wrapping:\n"
            + "\n".join(problems)
        )
    options_differ: dict[str, list[str]] = {}
    for rank, _e, other_options, _n, _s in summaries[1:]:
        for key in sorted(set(ref_options) | set(other_options)):
            if ref_options.get(key) != other_options.get(key):
                options_differ.setdefault(key, []).append(
                    f"rank {rank}: {other_options.get(key)} (rank {reference_rank}: "
                    f"{ref_options.get(key)})"
                )
    if options_differ:
        lines = [f"{key}: " + "; ".join(ranks) for key, ranks in options_differ.items()]
        raise ValueError(
            "fsdp wrapping options differ across data-parallel ranks; every rank must wrap "
            "with the same options:\n" + "\n".join(lines)
        )
    differ: list[str] = []
    for _rank, _e, _o, names, sums in summaries[1:]:
        for j, name in enumerate(names):
            if name in differ:
                continue
            if ref_sums is None or not torch.equal(sums[j], ref_sums[ref_names.index(name)]):
                differ.append(name)
    return differ


def check_tensor_parallel_replicas(module: nn.Module, dist_index) -> TensorParallel:
    """Classify the parameters for tensor parallelism (``fsdp_buffers.tensor_parallel``,
    which raises on bad input, alike on every rank), then check that the parameters
    replicated over tp hold the same values on every tp rank: a model seeded per rank
    would otherwise train diverging copies without a word. One all-gather of two
    float64 checksums per replicated parameter over the tp group. Returns the
    classification, for the buffer (``ParamAndGradBuffer(tensor_parallel=...)``): the
    parameters are classified once per wrap."""
    tp = TensorParallel(module, dist_index)
    specs = tp.specs
    if specs is None or dist_index.tp_size <= 1:
        return tp
    names = {p: n for n, p in module.named_parameters()}
    # Meta parameters have no values yet: meta-device initialization draws them alike
    # on every tp rank (it checks the random generators).
    replicated = [p for p, s in specs.items() if s.kind is TPKind.REPLICATED and not p.is_meta]
    if not replicated:
        return tp
    with torch.no_grad():
        mine = torch.stack(
            [torch.stack([p.double().sum(), p.double().square().sum()]) for p in replicated]
        )
    group = dist_index.tp_group
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine.contiguous(), group=group)
    differ = [
        names[p]
        for j, p in enumerate(replicated)
        if any(not torch.equal(other[j], everyone[0][j]) for other in everyone[1:])
    ]
    if differ:
        raise ValueError(
            f"parameters {differ[:5]} are replicated over the tensor-parallel dim "
            f"{dist_index.tp_dim!r} (plain tensors without a tensor-parallel mark) but hold "
            "different values on its ranks; seed their initialization alike on every tp rank "
            "(fsdp_mesh.model_parallel_seed), or mark them tensor-parallel (a DTensor on "
            "the tp mesh, or Megatron-Core's tensor_model_parallel and partition_dim)"
        )
    return tp


def broadcast_from_dp_rank0(module: nn.Module, names: list[str], dist_index) -> None:
    """Initial values that differ across data-parallel ranks (a per-rank seed): take
    data-parallel rank 0's, as torch DDP does at construction, and say so once."""
    group = dist_index.get_dp_group()
    src = dist.get_global_rank(group, 0)
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name in names:
            p = params[name]
            local = p.to_local() if isinstance(p, DTensor) else p
            dist.broadcast(local.data, src=src, group=group)
    if dist.get_rank(group) == 0:
        logger.warning(
            "fsdp: %d parameters (%s) held different initial values across data-parallel "
            "ranks; data-parallel rank 0's were broadcast, as torch DDP does. Seed the "
            "initialization alike on every rank to avoid this.",
            len(names),
            ", ".join(names[:5]) + (", ..." if len(names) > 5 else ""),
        )


def check_param_dtype(module: nn.Module, policy: MixedPrecisionPolicy) -> None:
    """FSDP2's ``param_dtype``: the buffers make the compute copy of every trainable
    parameter, whose main weights keep its own precision. A frozen floating parameter
    has no main weights, so in another dtype it is refused rather than kept only as
    its ``param_dtype`` rounding (which the state dict would then give)."""
    want = policy.param_dtype
    if want is None:
        return
    frozen = [
        name
        for name, p in module.named_parameters()
        if p.is_floating_point() and not p.requires_grad and p.dtype != want
    ]
    if frozen:
        raise ValueError(
            f"MixedPrecisionPolicy(param_dtype={want}): frozen (requires_grad=False) "
            f"parameters {frozen[:5]} are {module.get_parameter(frozen[0]).dtype}. fsdp "
            f"keeps full-precision main weights only for trainable parameters, so it "
            f"would hold frozen ones only as their {want} rounding: cast them to {want} "
            f"before wrapping (or leave param_dtype unset)"
        )
