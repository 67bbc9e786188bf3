"""The optimizer's step under fsdp: the gradients synchronised, the step (on the plain
local shards where that is exact), the updated weights installed.

``patch_optimizer`` (the last thing ``fully_shard_optimizer`` does) wraps one optimizer
instance's ``step`` and ``zero_grad``: ``step()`` finishes the gradient sync, steps
(``LocalStep``) and installs the main weights into the compute weights; ``zero_grad()``
also zeros the model's gradient buffers. Both take Megatron-FSDP's extra keywords
(``sync_grad_before_optimizer_step``, ``install_optimized_model_weights``,
``zero_grad_buffer``). Optimizers passed to ``fully_shard`` together share a
``StepRound``: the first to step syncs, the last installs. The model is reached through
``FSDPModel``, the methods of ``MegatronFSDP`` these call (``optim`` sits below
``module``).

Note [local step]: the optimizer's parameters are DTensors over this rank's shard of the
main weights (``dtensor_views``), its gradients DTensors over the main-grad shard, its
state DTensors placed like the parameter. For an optimizer whose update is element-wise
(every state tensor has one entry per parameter entry, the rest are 0-d scalars such as
``step``), stepping the local tensors gives exactly what the DTensor step gives, without
DTensor's per-op spec building and dispatch (most of the step's host time on many small
parameters; FSDP2 pays it too). So ``optimizer.step()`` under fsdp runs the optimizer's
own ``step`` with, for its duration only:

- each group's ``params`` list replaced by persistent plain "shadow" parameters, views of
  each DTensor parameter's local shard (in-place updates land in the main weights), whose
  ``.grad`` is the local tensor of the DTensor gradient (``None`` stays ``None``, so such
  parameters are skipped as before); the group dicts themselves are the user's, so every
  hyperparameter (``lr`` set by a scheduler, ``weight_decay``, ...) is read as set;
- ``optimizer.state`` replaced by a shadow state whose tensors are the local tensors of
  the real DTensor state (shared storage: the step's in-place updates are the real
  state's). A value the step replaces or creates instead (a new object; all of a
  parameter's state on its first step) is written back, wrapped as a DTensor placed as
  its parameter when it is a per-element key, as the DTensor step would create it.

Before and after, ``optimizer.param_groups`` and ``optimizer.state`` are what they are
on the DTensor path (DTensor parameters, DTensor state), so ``state_dict()``,
``load_state_dict``, DCP, schedulers, ``add_param_group`` and ``zero_grad`` see no
difference. The state and gradients are checked every step, and the step runs on the
DTensors instead, as before, whenever anything is not as this requires. The checks are
cheap: the last step's plan (shadows and shadow state) is reused while the groups, their
options that matter here, their parameters, each one's local tensor and gradient, and
every state dict with its keys and values are the same objects as when it was built
(C-level maps, no Python call per parameter); anything else (a group added, a state
entry replaced, a new gradient) plans anew with the per-parameter checks below. A step
that replaced or added a state value is written back and the next one plans anew.

- the optimizer's class is not one of those ``optimizers.state_keys`` lists, exactly (a
  subclass may override the update), or a group is ``differentiable``;
- ``step`` gets arguments (a closure) or step hooks are registered (they would see the
  shadows);
- a state entry is not a known per-element key holding a DTensor placed as the parameter
  with the local shard's shape, or a known scalar key holding a 0-d plain tensor or a
  number (e.g. state loaded from a plain tensor);
- a gradient is not a DTensor placed as its parameter with the local shard's shape and
  dtype.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections import defaultdict
from collections.abc import Callable
from itertools import chain
from operator import attrgetter, is_, itemgetter
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import optimizer as torch_optimizer

from fsdp_buffers.whole_param import is_whole_parameter
from fsdp_hooks.optim.optim_init import InitialState
from fsdp_hooks.optim.optimizers import StateKeys, inner_parameters, state_keys

__all__ = ["FSDPModel", "LocalStep", "StepRound", "patch_optimizer"]


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    return bool(
        optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or torch_optimizer._global_optimizer_pre_hooks
        or torch_optimizer._global_optimizer_post_hooks
    )


def _same_layout(value: DTensor, p: DTensor, local: torch.Tensor) -> bool:
    """``value`` is a DTensor placed as ``p`` whose local tensor is shaped like ``p``'s."""
    vs, ps = value._spec, p._spec
    return (
        value._local_tensor.shape == local.shape
        and (vs.placements is ps.placements or vs.placements == ps.placements)
        and (vs.mesh is ps.mesh or vs.mesh == ps.mesh)
    )


class _Shadow:
    """One DTensor parameter's shadow and what was last checked of it (reused while the
    gradient, the state dict and its values are the same objects)."""

    __slots__ = (
        "entries",
        "grad",
        "grad_local",
        "handed",
        "handed_seen",
        "local",
        "param",
        "seen",
        "shadow",
        "values",
    )

    def __init__(self, p: DTensor) -> None:
        self.param = p  # kept alive: the cache is keyed by id
        self.local = p._local_tensor
        self.shadow = nn.Parameter(self.local.detach(), requires_grad=p.requires_grad)
        self.grad: object = None
        self.grad_local: torch.Tensor | None = None
        self.entries: dict[str, Any] | None = None  # the real state dict checked last
        self.seen: tuple = ()  # its keys and the ids of its values then
        # Those values, kept alive so that no new object can take one of their ids.
        self.values: tuple = ()
        # The shadow state handed to the step (copied: the copy is the optimizer's to
        # change), and its keys and value ids, for the write-back.
        self.handed: dict[str, Any] = {}
        self.handed_seen: tuple = ()


def _seen(entries: dict[str, Any]) -> tuple:
    return (*entries, *map(id, entries.values()))


class _Plan:
    """One step's shadows: per group the shadow list, the shadow state, and the
    parameters that have a gradient (to write back what the step replaced)."""

    def __init__(self) -> None:
        self.groups: list[list[nn.Parameter]] = []
        self.state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        self.stepped: list[_Shadow] = []


_params_of = itemgetter("params")
_grad_of = attrgetter("grad")
_local_of = attrgetter("_local_tensor")


def _same(a: list, b: list) -> bool:
    """The same objects in the same order."""
    return len(a) == len(b) and all(map(is_, a, b))


class _Dicts:
    """A list of dicts, their keys and their values' identities, taken with C-level maps
    (no Python call per parameter): equal to a later snapshot exactly when no dict was
    replaced, and no entry added, removed or rebound."""

    __slots__ = ("dicts", "keys", "lens", "values")

    def __init__(self, dicts: list[dict[str, Any]]) -> None:
        self.dicts = dicts
        self.lens = list(map(len, dicts))
        self.keys = list(chain.from_iterable(dicts))
        self.values = list(chain.from_iterable(map(dict.values, dicts)))

    def unchanged(self, dicts: list[dict[str, Any]]) -> bool:
        return (
            _same(dicts, self.dicts)
            and list(map(len, dicts)) == self.lens
            and list(chain.from_iterable(dicts)) == self.keys
            and _same(list(chain.from_iterable(map(dict.values, dicts))), self.values)
        )


class _Snapshot:
    """What a plan was built from (Note [local step]): the groups, their flags and
    parameters, each parameter's local tensor and gradient, and the whole optimizer
    state (its keys, dicts, and their entries). A plan is reused while all of it is the
    same objects; anything else rebuilds it with every check. Also the shadow state
    handed to the step, to tell after it whether the step replaced anything."""

    __slots__ = (
        "flags",
        "grads",
        "groups",
        "handed",
        "locals",
        "params",
        "plan",
        "sizes",
        "state",
        "state_dicts",
        "state_keys",
    )

    def __init__(self, step: LocalStep, optimizer: torch.optim.Optimizer, plan: _Plan) -> None:
        groups = optimizer.param_groups
        self.plan = plan
        self.groups = list(groups)
        self.flags = step._group_flags(groups)
        self.sizes = list(map(len, map(_params_of, groups)))
        self.params = list(chain.from_iterable(map(_params_of, groups)))
        self.locals = list(map(_local_of, self.params))
        self.grads = list(map(_grad_of, self.params))
        self.state = optimizer.state
        self.state_keys = list(self.state)
        self.state_dicts = _Dicts(list(self.state.values()))
        self.handed = _Dicts(list(plan.state.values()))

    def still_valid(self, step: LocalStep, optimizer: torch.optim.Optimizer) -> bool:
        groups = optimizer.param_groups
        if not _same(groups, self.groups) or step._group_flags(groups) != self.flags:
            return False
        if list(map(len, map(_params_of, groups))) != self.sizes:
            return False
        params = list(chain.from_iterable(map(_params_of, groups)))
        if not (
            _same(params, self.params)
            and _same(list(map(_local_of, params)), self.locals)
            and _same(list(map(_grad_of, params)), self.grads)
        ):
            return False
        state = optimizer.state
        return (
            state is self.state
            and _same(list(state), self.state_keys)
            and self.state_dicts.unchanged(list(state.values()))
        )


class LocalStep:
    """Runs an optimizer's step on the local shards when that is exact (see Note
    [local step]); one per patched optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._kind = state_keys(optimizer, exact=True)
        self._shadows: dict[int, _Shadow] = {}  # by id of the DTensor parameter
        # The last plan and what it was built from, reused while that is unchanged.
        self._snapshot: _Snapshot | None = None
        self.last_step_was_local = False  # for tests and profiles
        self.last_plan_was_reused = False  # for tests

    def _shadow(self, p: DTensor) -> _Shadow:
        entry = self._shadows.get(id(p))
        if entry is None or entry.param is not p or entry.local is not p._local_tensor:
            entry = self._shadows[id(p)] = _Shadow(p)
        return entry

    def _check_state(self, entry: _Shadow, entries: dict[str, Any]) -> dict[str, Any] | None:
        """The shadow state of one parameter (local tensors of the real state), or None
        when its state is not what the local step requires."""
        kind = self._kind
        assert kind is not None
        p, local = entry.param, entry.shadow
        handed: dict[str, Any] = {}
        for key, value in entries.items():
            if key in kind.per_element:
                if not (isinstance(value, DTensor) and _same_layout(value, p, local)):
                    return None
                handed[key] = value._local_tensor
            elif key in kind.scalars:
                if isinstance(value, DTensor) or (
                    isinstance(value, torch.Tensor) and value.ndim != 0
                ):
                    return None
                handed[key] = value
            else:
                return None
        return handed

    def _group_flags(self, groups: list[dict[str, Any]]) -> list[tuple[bool, bool]]:
        """Per group, what its options decide for the plan: differentiable, stateless."""
        kind = self._kind
        assert kind is not None
        stateless = kind.stateless
        return [
            (bool(g.get("differentiable", False)), stateless is not None and stateless(g))
            for g in groups
        ]

    def _reused_or_new_plan(self, optimizer: torch.optim.Optimizer) -> _Plan | None:
        """The last plan when nothing it was built from changed (cheap identity checks),
        else a new one (``_plan``: every check)."""
        snapshot = self._snapshot
        if snapshot is not None and snapshot.still_valid(self, optimizer):
            self.last_plan_was_reused = True
            return snapshot.plan
        self.last_plan_was_reused = False
        self._snapshot = None
        plan = self._plan(optimizer)
        if plan is not None:
            self._snapshot = _Snapshot(self, optimizer, plan)
        return plan

    def _plan(self, optimizer: torch.optim.Optimizer) -> _Plan | None:
        kind = self._kind
        assert kind is not None
        plan = _Plan()
        state = optimizer.state
        for group in optimizer.param_groups:
            if group.get("differentiable", False):
                return None
            stateless = kind.stateless is not None and kind.stateless(group)
            shadows: list[nn.Parameter] = []
            for p in group["params"]:
                if not isinstance(p, DTensor):
                    return None
                entry = self._shadow(p)
                shadows.append(entry.shadow)
                grad = p.grad
                if grad is None:
                    continue  # skipped by the step, as before; its state is not touched
                if grad is not entry.grad:
                    if not (
                        isinstance(grad, DTensor)
                        and grad.dtype == p.dtype
                        and _same_layout(grad, p, entry.shadow)
                    ):
                        return None
                    entry.grad, entry.grad_local = grad, grad._local_tensor
                plan.stepped.append(entry)
                entries = state.get(p)
                if not entries:
                    # No state (yet): the step creates it on the shadow, and it is
                    # written back (in parameter order, as the DTensor step adds it) as
                    # DTensors placed as the parameters.
                    entry.entries, entry.seen, entry.values = None, (), ()
                    entry.handed, entry.handed_seen = {}, ()
                    if not stateless:
                        plan.state[entry.shadow] = {}
                    continue
                if entries is not entry.entries or _seen(entries) != entry.seen:
                    handed = self._check_state(entry, entries)
                    if handed is None:
                        entry.entries = None
                        return None
                    entry.entries, entry.seen = entries, _seen(entries)
                    entry.values = tuple(entries.values())
                    entry.handed, entry.handed_seen = handed, _seen(handed)
                plan.state[entry.shadow] = entry.handed.copy()
            plan.groups.append(shadows)
        return plan

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        base_step: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """``base_step(*args, **kwargs)``, on the local shards when exact."""
        plan = None
        if self._kind is not None and not args and not kwargs and not _has_step_hooks(optimizer):
            plan = self._reused_or_new_plan(optimizer)
        self.last_step_was_local = plan is not None
        if plan is None:
            return base_step(*args, **kwargs)
        groups = optimizer.param_groups
        saved_params = [group["params"] for group in groups]
        saved_state = optimizer.state
        try:
            for entry in plan.stepped:
                entry.shadow.grad = entry.grad_local
            for group, shadows in zip(groups, plan.groups, strict=True):
                group["params"] = shadows
            optimizer.state = plan.state
            result = base_step()
        except BaseException:
            self._snapshot = None  # the shadow state may be half-updated: plan anew
            raise
        finally:
            optimizer.state = saved_state
            for group, params in zip(groups, saved_params, strict=True):
                group["params"] = params
            for entry in plan.stepped:
                entry.shadow.grad = None
        # Whether the step replaced or added anything: then it is written back, and the
        # next step plans anew.
        snapshot = self._snapshot
        changed = snapshot is None or not snapshot.handed.unchanged(list(plan.state.values()))
        if changed:
            self._snapshot = None
            self._write_back(saved_state, plan)
        return result

    def _write_back(self, state: defaultdict[torch.Tensor, Any], plan: _Plan) -> None:
        """Put into the real state what the step replaced or created (most steps update
        every tensor in place and write nothing here)."""
        kind = self._kind
        assert kind is not None
        for entry in plan.stepped:
            after = plan.state.get(entry.shadow) or {}
            if _seen(after) == entry.handed_seen:
                continue
            handed = entry.handed
            p = entry.param
            real = state[p]
            for key in handed:
                if key not in after:
                    real.pop(key, None)
            for key, value in after.items():
                if handed.get(key, _MISSING) is not value:
                    real[key] = self._wrap(key, value, p, entry.shadow, kind)
            entry.entries = None  # checked again next step

    @staticmethod
    def _wrap(key: str, value: Any, p: DTensor, shadow: torch.Tensor, kind: StateKeys) -> Any:
        if key in kind.per_element:
            if not (isinstance(value, torch.Tensor) and value.shape == shadow.shape):
                raise RuntimeError(
                    f"{type(value).__name__} {key!r} of the optimizer state came out of a "
                    f"local step with shape {getattr(value, 'shape', None)}, not the local "
                    f"shard's {tuple(shadow.shape)}: this optimizer's update is not "
                    "element-wise (report it; fsdp_hooks.optim.optimizers lists the optimizers "
                    "stepped locally)"
                )
            return DTensor.from_local(
                value,
                p.device_mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
        if key in kind.scalars and not (isinstance(value, torch.Tensor) and value.ndim != 0):
            return value
        raise RuntimeError(
            f"the optimizer state key {key!r} came out of a local step and is neither a "
            "known per-element tensor nor a scalar of this optimizer; its update may not "
            "be element-wise (report it; fsdp_hooks.optim.optimizers lists the optimizers "
            "stepped locally)"
        )


_MISSING = object()


# ---- the patched step and zero_grad --------------------------------------------------
class _InstallOptions(Protocol):
    @property
    def overlap_param_gather(self) -> bool: ...


class FSDPModel(Protocol):
    """What the patched ``step`` and ``zero_grad`` call on the model (``MegatronFSDP``'s
    methods of these names)."""

    @property
    def ddp_config(self) -> _InstallOptions: ...

    def finish_grad_sync(self) -> None: ...

    def attach_grad_to_optimizer_state(self) -> None: ...

    def install_optimized_model_weights(self, *, defer: bool = False) -> None: ...

    def zero_grad_buffer(self) -> None: ...


class StepRound:
    """Optimizers passed to ``fully_shard`` together share one gradient sync and one
    install per step: the first to step syncs, the last installs."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.stepped: set[int] = set()

    def check_complete(self, *_args: Any) -> None:
        if self.stepped:
            raise RuntimeError(
                f"forward after {len(self.stepped)} of the {self.count} optimizers passed to "
                "fully_shard together stepped: the weights are installed once all of them "
                "have stepped; call step() on every one of them before the next forward"
            )


def patch_optimizer(
    optimizer: torch.optim.Optimizer,
    model: FSDPModel,
    initial: InitialState,
    step_round: StepRound | None = None,
) -> None:
    """Wrap ``step`` and ``zero_grad`` of this optimizer instance. They stay bound
    methods (``types.MethodType``): torch's ``LRScheduler`` built afterwards wraps
    ``optimizer.step`` through its ``__func__``."""
    optimizer._fsdp_model_ref = weakref.ref(model)  # type: ignore[attr-defined]
    # For model.memory_stats(); weak, so the model does not keep the optimizer alive.
    model.__dict__["_fsdp_optimizer_ref"] = weakref.ref(optimizer)
    base_step = optimizer.step
    base_zero_grad = optimizer.zero_grad
    # Element-wise optimizers step the plain local shards (Note [local step]).
    local_step = LocalStep(optimizer)
    optimizer._fsdp_local_step = local_step  # type: ignore[attr-defined]

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        sync = kwargs.pop("sync_grad_before_optimizer_step", True)
        install = kwargs.pop("install_optimized_model_weights", True)
        if step_round is not None:
            if id(self) in step_round.stepped:
                raise RuntimeError(
                    "this optimizer stepped twice before the other optimizers passed to "
                    "fully_shard with it stepped once; step each of them once per step"
                )
            sync = sync and not step_round.stepped
            step_round.stepped.add(id(self))
            if len(step_round.stepped) < step_round.count:
                install = False
            else:
                step_round.stepped.clear()
        if sync:
            model.finish_grad_sync()
        else:
            model.attach_grad_to_optimizer_state()
        # Whole placement only: the param groups hold the tensors fsdp steps meanwhile.
        shows_whole = getattr(self, "_fsdp_shows_whole", False)
        with inner_parameters(optimizer) if shows_whole else contextlib.nullcontext():
            if initial.created:
                initial.drop_untouched(optimizer)
            result = local_step.step(optimizer, base_step, args, kwargs)
        if install:
            # With overlap_param_gather, ZeRO-1/2 gathers overlap the next forward.
            model.install_optimized_model_weights(defer=model.ddp_config.overlap_param_gather)
        return result

    def zero_grad(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        zero_buffer = kwargs.pop("zero_grad_buffer", True)
        shows_whole = getattr(self, "_fsdp_shows_whole", False)
        with inner_parameters(optimizer) if shows_whole else contextlib.nullcontext():
            base_zero_grad(*args, **kwargs)
        if shows_whole and kwargs.get("set_to_none", args[0] if args else True):
            for group in self.param_groups:  # WholeParameters: as torch does to the others
                for p in group["params"]:
                    if is_whole_parameter(p):
                        p.grad = None
        if zero_buffer:
            model.zero_grad_buffer()

    step.__doc__ = base_step.__doc__
    zero_grad.__doc__ = base_zero_grad.__doc__
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)  # type: ignore[method-assign]
