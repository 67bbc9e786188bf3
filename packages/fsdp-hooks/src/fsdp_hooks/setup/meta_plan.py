"""The plan of meta-device initialization (the note on meta initialization in ``meta_init``):
which initializer (a module's own ``reset_parameters``/``_reset_parameters``, or a
Hugging Face model's ``_init_weights``) writes which pending parameter, in the post-order
``nn.Module.apply`` would run them; meta buffers none reaches are left to the root
module's ``init_weights()`` where it defines one (Note [the model's init_weights] in
``meta_init``); anything else no initializer can reach is refused by name before any
work."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

__all__ = ["Plan", "Reset", "make_plan"]


# ---- the plan -----------------------------------------------------------------------------
@dataclass(eq=False)
class Reset:
    """One ``reset_parameters()`` call: module ``name`` at post-order position ``index``."""

    index: int
    name: str
    module: nn.Module
    run: Callable[[], None]  # reset_parameters() and/or the model's _init_weights(module)
    scratch: list[str]  # direct parameters swapped for scratch tensors during the call
    touches: list[nn.Parameter]  # pending parameters the call may write


@dataclass(eq=False)
class Plan:
    resets: list[Reset] = field(default_factory=list)
    param_names: dict[nn.Parameter, str] = field(default_factory=dict)
    meta_buffers: list[tuple[nn.Module, str, str]] = field(default_factory=list)
    # Meta buffers no reset reaches, left to the root module's init_weights() once the
    # model is wrapped (Note [the model's init_weights] in meta_init).
    left_to_init_weights: list[tuple[nn.Module, str, str]] = field(default_factory=list)


def _post_order(module: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """(name, module, index of the first module of its subtree), children first; a
    module reachable twice is visited once, under its first name (as ``named_modules``)."""
    out: list[tuple[str, nn.Module, int]] = []
    seen: set[int] = set()

    def visit(name: str, mod: nn.Module) -> None:
        seen.add(id(mod))
        start = len(out)
        for child_name, child in mod._modules.items():
            if child is not None and id(child) not in seen:
                visit(f"{name}.{child_name}" if name else child_name, child)
        out.append((name, mod, start))

    visit("", module)
    return out


def _full(mod_name: str, attr: str) -> str:
    return f"{mod_name}.{attr}" if mod_name else attr


def _own_reset(mod: nn.Module) -> Callable[[], object] | None:
    """The module's own reset: ``reset_parameters()``, else ``_reset_parameters()``
    (``nn.MultiheadAttention`` and other torch modules that spell it so)."""
    for attr in ("reset_parameters", "_reset_parameters"):
        fn = getattr(mod, attr, None)
        if callable(fn):
            return fn
    return None


def _model_initializers(module: nn.Module) -> dict[int, nn.Module]:
    """For every module, the nearest module at or above it with a callable
    ``_init_weights(module)``: a Hugging Face ``PreTrainedModel`` initializes its
    modules through it (``initialize_weights`` dispatches each module to the nearest
    such model above it, nested sub-models included), the convention this follows."""
    owners: dict[int, nn.Module] = {}

    seen: set[int] = set()

    def visit(mod: nn.Module, owner: nn.Module | None) -> None:
        seen.add(id(mod))  # a module reachable twice: its first place, as _post_order
        if callable(getattr(mod, "_init_weights", None)):
            owner = mod
        if owner is not None:
            owners[id(mod)] = owner
        for child in mod._modules.values():
            if child is not None and id(child) not in seen:
                visit(child, owner)

    visit(module, None)
    return owners


def _initializer(mod: nn.Module, owner: nn.Module | None) -> Callable[[], None] | None:
    """What initializes ``mod``: its own reset, then (for a Hugging Face model) the
    model's ``_init_weights(mod)``, which overrides what the reset drew, as in an eager
    construction (``__init__`` resets, then ``post_init`` runs ``_init_weights``)."""
    reset = _own_reset(mod)
    init_weights = getattr(owner, "_init_weights", None) if owner is not None else None
    if reset is None and init_weights is None:
        return None

    def run() -> None:
        if reset is not None:
            reset()
        if init_weights is not None:
            init_weights(mod)

    return run


def make_plan(module: nn.Module, pending: set[nn.Parameter]) -> Plan:
    order = _post_order(module)
    plan = Plan()
    owner: dict[nn.Parameter, int] = {}
    for index, (name, mod, _start) in enumerate(order):
        for attr, p in mod._parameters.items():
            if p is not None and p in pending and p not in owner:
                owner[p] = index
                plan.param_names[p] = _full(name, attr)
    for name, mod, _start in order:
        for attr, b in mod._buffers.items():
            if b is not None and b.is_meta:
                plan.meta_buffers.append((mod, attr, _full(name, attr)))

    covered: set[nn.Parameter] = set()
    covered_buffer_modules: set[int] = set()
    owners = _model_initializers(module)
    for index, (name, mod, start) in enumerate(order):
        run = _initializer(mod, owners.get(id(mod)))
        if run is None:
            continue
        # A reset may reach its whole subtree (torch's convention); a model's
        # _init_weights(module) initializes that module's own tensors (it is applied to
        # every module, as nn.Module.apply does).
        if _own_reset(mod) is not None:
            subtree = [m for _n, m, _s in order[start : index + 1]]
        else:
            subtree = [mod]
        reached = [
            p for m in subtree for p in m._parameters.values() if p is not None and p in pending
        ]
        has_meta_buffer = any(
            b is not None and b.is_meta for m in subtree for b in m._buffers.values()
        )
        if not reached and not has_meta_buffer:
            continue  # nothing of this subtree was on the meta device: keep it as is
        scratch = [
            attr
            for attr, p in mod._parameters.items()
            if p is not None and (p not in pending or owner[p] != index)
        ]
        swapped = {id(mod._parameters[attr]) for attr in scratch}
        touches: list[nn.Parameter] = []
        for p in reached:
            if id(p) not in swapped:
                swapped.add(id(p))  # also dedups: a tied parameter is reached twice
                touches.append(p)
        covered.update(touches)
        covered_buffer_modules.update(id(m) for m in subtree)
        plan.resets.append(Reset(index, name, mod, run, scratch, touches))

    missing = [
        f"{plan.param_names[p]} ({type(order[owner[p]][1]).__name__})"
        for p in plan.param_names
        if p not in covered
    ]
    unreached = [entry for entry in plan.meta_buffers if id(entry[0]) not in covered_buffer_modules]
    if callable(getattr(module, "init_weights", None)):
        plan.left_to_init_weights = unreached
    else:
        missing += [f"{full} (buffer of {type(mod).__name__})" for mod, _attr, full in unreached]
    if missing:
        raise ValueError(
            f"meta-device initialization cannot initialize {missing[:10]}"
            f"{f' and {len(missing) - 10} more' if len(missing) > 10 else ''}: neither the "
            f"module that owns them nor any module above it defines reset_parameters() "
            f"(or _reset_parameters(), or a model's _init_weights(module)). fsdp "
            f"materializes a meta model by calling reset_parameters() on its modules (as "
            f"PyTorch FSDP does), then a Hugging Face model's _init_weights(module); values set in __init__ (nn.Parameter(torch.ones(n)), "
            f"torch.randn(...)) are not recorded on the meta device. Define "
            f"reset_parameters() on those modules to initialize them, or build them on a "
            f"real device before wrapping (tensors not on the meta device keep their values). "
            f"Or, as on FSDP2's model, wrap without init_model_with_meta_device, then "
            f"model.to_empty(device=...) and run the model's own init (init_weights()); "
            f"meta buffers are left to the root module's init_weights() when it has one."
        )
    return plan
