"""Which ``torch.optim`` optimizers can step fsdp's sharded main weights, the state keys
of the element-wise ones (``state_keys``, what the local step relies on), and moving
state an optimizer already holds onto them.

The optimizer steps DTensor parameters holding this rank's shard (ZeRO-1/2/3) or a
replica (``no_shard``). Element-wise optimizers (SGD, Adam, AdamW, Adamax, NAdam, RAdam,
Adagrad, Adadelta, RMSprop, Rprop, ASGD) give the step of one process on the whole
tensor. Refused at wrap, with the reason:

- ``LBFGS``: its ``step(closure)`` runs forward and backward itself and reads the
  gradients before fsdp's ``step`` could reduce them, and it works on one flat vector
  of every parameter.
- ``SparseAdam``: it needs sparse gradients; fsdp's gradients are dense buffers.
- ``Rprop`` (unless ``capturable``) over a 0-d parameter: its step indexes the parameter's
  0-d DTensor with a boolean mask, which torch turns into a plain index tensor that
  DTensor refuses to mix in (a torch limit; its ``capturable`` path uses ``torch.where``).
  Before torch 2.15, ``Rprop`` (unless ``capturable``) over any parameter: DTensor has no
  in-place masked assignment that keeps a shard (``dtensor_masked_assign_keeps_shard``
  in ``fsdp_mesh.versions``).
- ``Adafactor`` and ``Muon`` under a sharding strategy (1-3), for parameters that are not
  whole-placed: they need whole rows and columns and per-tensor RMS (Adafactor, for every
  parameter with a dim) or whole matrices (Muon's orthogonalization), which a row piece
  does not hold locally.
  ``fully_shard`` places their matrices whole (Note [whole placement] in
  ``fsdp_buffers.layout``): each is held, with its gradient and state, by one rank, which
  steps it exactly; ``fsdp_whole_placement`` marks parameters for
  ``fully_shard_model`` + ``fully_shard_optimizer``. Under ``no_shard`` (0) every rank
  holds the whole matrix anyway.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from fsdp_buffers.no_shard import FSDP_WHOLE_ATTR
from fsdp_buffers.whole_param import inner_of, is_whole_parameter
from fsdp_mesh.versions import dtensor_masked_assign_keeps_shard

__all__ = [
    "StateKeys",
    "check_optimizer_supported",
    "inner_parameters",
    "is_whole_matrix_optimizer",
    "mark_whole_placement",
    "move_state_to_main_weights",
    "refuse_positional_expert_state_in_dcp",
    "show_whole_parameters",
    "state_keys",
]


def _class(name: str) -> type | None:
    return getattr(torch.optim, name, None)


@dataclass(frozen=True)
class StateKeys:
    """The state keys of one element-wise optimizer class: per-element tensors (shaped
    like the parameter) and scalars (0-d tensors or numbers, alike for every element);
    ``stateless``: a group option under which the class keeps no state at all."""

    per_element: frozenset[str]
    scalars: frozenset[str]
    stateless: Callable[[dict[str, Any]], bool] | None = None


def _keys(per_element: str, scalars: str = "step", stateless=None) -> StateKeys:
    return StateKeys(frozenset(per_element.split()), frozenset(scalars.split()), stateless)


# Checked against torch 2.15's implementations: every update is element-wise given the
# group's hyperparameters and the scalar state (what Note [local step] relies on).
_ELEMENT_WISE_BY_NAME: dict[str, StateKeys] = {
    "SGD": _keys("momentum_buffer", "", stateless=lambda group: group["momentum"] == 0),
    "Adam": _keys("exp_avg exp_avg_sq max_exp_avg_sq"),
    "AdamW": _keys("exp_avg exp_avg_sq max_exp_avg_sq"),
    "Adamax": _keys("exp_avg exp_inf"),
    "NAdam": _keys("exp_avg exp_avg_sq", "step mu_product"),
    "RAdam": _keys("exp_avg exp_avg_sq"),
    "Adagrad": _keys("sum"),
    "Adadelta": _keys("square_avg acc_delta"),
    "RMSprop": _keys("square_avg momentum_buffer grad_avg"),
    "Rprop": _keys("prev step_size"),
    "ASGD": _keys("ax", "step eta mu"),
}
_ELEMENT_WISE: dict[type, StateKeys] = {
    cls: keys for name, keys in _ELEMENT_WISE_BY_NAME.items() if (cls := _class(name)) is not None
}


def state_keys(optimizer: torch.optim.Optimizer, exact: bool = False) -> StateKeys | None:
    """The state keys of ``optimizer``'s class, or (unless ``exact``: the local step
    needs the class's own update, which a subclass may override) of its nearest listed
    base class (a subclass creates its base's state, whatever it does to the update);
    None: unknown."""
    if exact:
        return _ELEMENT_WISE.get(type(optimizer))
    for cls in type(optimizer).__mro__:
        keys = _ELEMENT_WISE.get(cls)
        if keys is not None:
            return keys
    return None


def _whole_matrix_classes() -> tuple[type, ...]:
    return tuple(c for c in (_class("Adafactor"), _class("Muon")) if c is not None)


def is_whole_matrix_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps each matrix as a whole (Muon, Adafactor)."""
    classes = _whole_matrix_classes()
    return bool(classes) and isinstance(optimizer, classes)


def _is_whole(p: torch.Tensor) -> bool:
    return bool(getattr(p, FSDP_WHOLE_ATTR, False)) or hasattr(p, "_fsdp_whole_owner")


def muon_needs_whole(p: torch.Tensor) -> bool:
    """Whether Muon needs ``p`` whole: its matrices (it orthogonalizes each update).
    The planner marks a Muon job's parameters by this rule too."""
    return p.ndim >= 2


def _needs_whole(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> bool:
    """Whether ``optimizer`` needs ``p`` whole: Muon's matrices; every Adafactor parameter
    with a dim (it scales each update by the tensor's RMS and clips it by the update's
    RMS: per-tensor norms, not element-wise, so a row piece steps differently)."""
    adafactor = _class("Adafactor")
    if adafactor is not None and isinstance(optimizer, adafactor):
        return p.ndim >= 1
    return muon_needs_whole(p)


def mark_whole_placement(optimizer: torch.optim.Optimizer) -> None:
    """Mark what a whole-matrix optimizer needs whole for whole placement (before the
    model is wrapped): its step then holds each such parameter whole on one rank."""
    if is_whole_matrix_optimizer(optimizer):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if _needs_whole(optimizer, p):
                    setattr(p, FSDP_WHOLE_ATTR, True)


def show_whole_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Show the model's ``WholeParameter``s (``fsdp_buffers.whole_param``) in the param
    groups and state keys instead of the tensors fsdp steps, as ``model.parameters()``
    shows them: the optimizer's parameters are the model's, as under FSDP2."""
    optimizer._fsdp_shows_whole = True  # type: ignore[attr-defined]
    for group in optimizer.param_groups:
        group["params"] = [getattr(p, "_fsdp_guard", p) for p in group["params"]]
    state = optimizer.state
    for key in [k for k in state if hasattr(k, "_fsdp_guard")]:
        state[key._fsdp_guard] = state.pop(key)


@dataclass(frozen=True)
class _InnerLists:
    """What ``inner_parameters`` swaps in, built for param groups holding exactly the
    parameters ``shown`` (one tuple per group; kept, so their ids stay theirs): each
    group's list of the tensors fsdp steps, and the (WholeParameter, inner tensor) pairs
    whose state keys move."""

    shown: tuple[tuple[torch.Tensor, ...], ...]
    ids: tuple[tuple[int, ...], ...]
    inner: tuple[list[torch.Tensor], ...]
    whole: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    @classmethod
    def of(cls, groups: list[dict[str, Any]]) -> _InnerLists:
        shown = tuple(tuple(g["params"]) for g in groups)
        whole = {id(p): (p, inner_of(p)) for ps in shown for p in ps if is_whole_parameter(p)}
        return cls(
            shown=shown,
            ids=tuple(tuple(map(id, ps)) for ps in shown),
            inner=tuple([inner_of(p) for p in ps] for ps in shown),
            whole=tuple(whole.values()),
        )


def _inner_lists(optimizer: torch.optim.Optimizer) -> _InnerLists:
    """The optimizer's ``_InnerLists``, rebuilt only when its param groups no longer hold
    the very parameters it was built for (a user's edit: a new group, a list replaced or
    changed in place)."""
    ids = tuple(tuple(map(id, g["params"])) for g in optimizer.param_groups)
    lists = getattr(optimizer, "_fsdp_inner_lists", None)
    if lists is None or lists.ids != ids:
        lists = _InnerLists.of(optimizer.param_groups)
        optimizer._fsdp_inner_lists = lists  # type: ignore[attr-defined]
    return lists


@contextlib.contextmanager
def inner_parameters(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """While torch's own optimizer code runs (fsdp's ``step``/``zero_grad``), the param
    groups and state keys hold the tensors fsdp steps (the whole main weight on the owner,
    a meta placeholder elsewhere), then the ``WholeParameter``s again (the groups' own
    lists). The inner lists are built once per set of param groups (``_inner_lists``)."""
    if not getattr(optimizer, "_fsdp_shows_whole", False):  # the usual case: nothing to do
        yield
        return
    lists = _inner_lists(optimizer)
    groups = optimizer.param_groups
    shown = [g["params"] for g in groups]
    for group, inner in zip(groups, lists.inner, strict=True):
        group["params"] = inner
    state = optimizer.state
    for guard, inner in lists.whole:
        if guard in state:
            state[inner] = state.pop(guard)
    try:
        yield
    finally:
        for group, params in zip(groups, shown, strict=True):
            group["params"] = params
        state = optimizer.state  # the step may have replaced it
        for guard, inner in lists.whole:
            if inner in state:
                state[guard] = state.pop(inner)


def _has_0d(params: list[torch.Tensor]) -> bool:
    return any(p.ndim == 0 and p.requires_grad for p in params)  # frozen: not stepped


def check_optimizer_supported(
    optimizer: torch.optim.Optimizer, sharded: bool, where: str = "fully_shard"
) -> None:
    """Raise ``TypeError`` for an optimizer that cannot step fsdp's main weights (see
    the module note). ``sharded``: the strategy shards the main weights (1-3). Local
    information only, alike on every rank."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{where}: optimizer must be a torch.optim.Optimizer built over the module's "
            f"parameters; got {type(optimizer).__name__} ({optimizer!r:.80}). Use "
            "fully_shard_model(module, ...) to shard a model without an optimizer."
        )
    name = type(optimizer).__name__
    lbfgs, sparse_adam = _class("LBFGS"), _class("SparseAdam")
    if lbfgs is not None and isinstance(optimizer, lbfgs):
        raise TypeError(
            f"{where}: {name} is not supported: its step(closure) runs forward and backward "
            "itself and reads gradients before fsdp reduces them, over one flat vector of "
            "every parameter; use a first-order optimizer (e.g. AdamW)"
        )
    if sparse_adam is not None and isinstance(optimizer, sparse_adam):
        raise TypeError(
            f"{where}: {name} is not supported: it needs sparse gradients and fsdp's "
            "gradients are dense buffers; use Adam or AdamW"
        )
    rprop = _class("Rprop")
    if rprop is not None and isinstance(optimizer, rprop):
        masked = [
            g
            for g in optimizer.param_groups
            if not g.get("capturable") and any(p.requires_grad for p in g["params"])
        ]
        if masked and not dtensor_masked_assign_keeps_shard():
            raise TypeError(
                f"{where}: {name} cannot step fsdp's main weights on torch "
                f"{torch.__version__}: its step assigns through a boolean mask "
                "(sign[sign.gt(0)] = etaplus, aten.index_put_), which DTensor supports on "
                "sharded tensors from torch 2.15 (2.11 has no sharding strategy for it); "
                "upgrade torch, pass capturable=True (CUDA), or use another optimizer "
                "(e.g. Adam)"
            )
        scalars = [g for g in masked if _has_0d(g["params"])]
        if scalars:
            raise TypeError(
                f"{where}: {name} cannot step a 0-d parameter (a scalar, shape ()) of fsdp's "
                "main weights: its step indexes the 0-d DTensor with a boolean mask "
                "(sign[sign.gt(0)] = etaplus), which torch turns into a plain index tensor "
                "that DTensor refuses to mix in; give the parameter shape (1,), or step it "
                "with another optimizer (e.g. Adam)"
            )
    if sharded and is_whole_matrix_optimizer(optimizer):
        matrices = [
            tuple(p.shape)
            for g in optimizer.param_groups
            for p in g["params"]
            if _needs_whole(optimizer, p) and not _is_whole(p)
        ]
        if matrices:
            raise TypeError(
                f"{where}: {name} needs whole matrices (their rows and columns) for each "
                f"step, and a sharding strategy (zero_dp_strategy 1-3) gives each rank a "
                f"row shard of the main weights (e.g. of {matrices[0]}), so the step would "
                "not be the one of a single process; pass the optimizer to fully_shard "
                "(which places its matrices whole on one rank each), or mark them with "
                "fsdp_whole_placement(...) before fully_shard_model, or use "
                "zero_dp_strategy=0 (no_shard)"
            )


def _shard_like(value: torch.Tensor, dparam: DTensor, what: str) -> DTensor:
    """``value`` (the whole tensor, alike on every rank) as a DTensor placed as
    ``dparam``: this rank's piece, cut locally (no communication)."""
    flat = value.detach().reshape(-1)
    if bool((flat == flat[0]).all()):
        # A fill (Adagrad's initial accumulator): the same on any placement.
        return torch.full_like(dparam.detach(), flat[0].item())
    mesh = dparam.device_mesh
    whole = DTensor.from_local(
        value.detach().to(device=dparam.device, dtype=dparam.dtype),
        mesh,
        [Replicate()] * mesh.ndim,
        run_check=False,
    )
    piece = whole.redistribute(mesh, dparam.placements)
    if piece.to_local().shape != dparam.to_local().shape:
        raise ValueError(
            f"cannot move the optimizer state {what} onto the sharded main weights: "
            f"its shard has shape {tuple(piece.to_local().shape)} on this rank, the "
            f"parameter's {tuple(dparam.to_local().shape)}; build the optimizer's state "
            "after fully_shard"
        )
    return piece


def _is_per_element(
    optimizer: torch.optim.Optimizer, key: str, value: Any, original: torch.Tensor
) -> bool:
    """Whether the state ``value`` has one entry per element of ``original`` (to be
    placed as its main weight) rather than being a scalar (``step``, kept as it is).
    The shape tells them apart except for a 0-d parameter, whose per-element state is
    0-d too (Adagrad's ``sum``): there the optimizer's known keys do."""
    if (
        not isinstance(value, torch.Tensor)
        or isinstance(value, DTensor)
        or value.shape != original.shape
    ):
        return False
    keys = state_keys(optimizer)
    if keys is not None and key in keys.per_element:
        return True
    if key == "step" or (keys is not None and key in keys.scalars):
        return False
    if original.ndim > 0:
        return True
    raise ValueError(
        f"cannot move the state {key!r} that {type(optimizer).__name__} already holds "
        "for a 0-d parameter onto the main weights: it is 0-d too, and this optimizer's "
        "state keys are not known, so whether it is per-element (placed as the "
        "parameter) or a scalar (kept) cannot be told; build the optimizer's state "
        "after fully_shard"
    )


def move_state_to_main_weights(
    optimizer: torch.optim.Optimizer, replaced: dict[nn.Parameter, nn.Parameter | None]
) -> None:
    """Re-key the state an optimizer already holds (``Adagrad`` creates it in
    ``__init__``; any optimizer after steps taken before wrapping) from each original
    parameter to its main-weight DTensor (``None``: dropped, a frozen parameter).
    Per-element tensors (``_is_per_element``) become this rank's piece of them, placed
    as the parameter (so state from steps before wrapping carries over exactly);
    others (``step`` counters) are kept."""
    moved: dict[nn.Parameter, dict[str, Any]] = {}
    for original, dparam in replaced.items():
        state = optimizer.state.get(original)
        if state is None or dparam is None or dparam.is_meta:
            continue  # frozen, or whole-placed on another rank (which keeps the state)
        if not isinstance(dparam, DTensor):  # whole-placed here: the state as it is
            moved[dparam] = {
                k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                for k, v in state.items()
            }
            continue
        moved[dparam] = {
            key: _shard_like(value, dparam, repr(key))
            if _is_per_element(optimizer, key, value, original)
            else value
            for key, value in state.items()
        }
    # Changed only once every entry could be moved: a refusal leaves it as it was.
    for original in replaced:
        optimizer.state.pop(original, None)
    optimizer.state.update(moved)


# ---- expert state in optimizer.state_dict() ------------------------------------------------
_POSITIONAL_MESSAGE = (
    "optimizer.state_dict() numbers parameters by their position, and under expert "
    "parallelism position {index} is a different expert on each expert-parallel rank: "
    "saving or loading it with torch.distributed.checkpoint would mix experts. Use "
    "fsdp.save_checkpoint / fsdp.load_checkpoint (or fsdp_ckpt.get_optimizer_state_dict), "
    "which key optimizer state by the experts' global names."
)


def _refuse_in_dcp(value: DTensor, index: int) -> DTensor:
    """``value`` over a view of the same storage whose DCP hooks raise: DCP asks a
    DTensor's local tensor for ``__create_write_items__`` (save) and
    ``__create_chunk_list__`` (load) first, so either raises instead of mixing experts.
    ``torch.save`` and ``load_state_dict`` see an ordinary DTensor."""
    local = value._local_tensor.view_as(value._local_tensor)

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise ValueError(_POSITIONAL_MESSAGE.format(index=index))

    local.__create_write_items__ = refuse  # type: ignore[attr-defined]
    local.__create_chunk_list__ = refuse  # type: ignore[attr-defined]
    # Not DTensor.from_local: it would wrap a fresh view of ``local``, without the hooks.
    return DTensor(local, value._spec, requires_grad=False)


def refuse_positional_expert_state_in_dcp(
    optimizer: torch.optim.Optimizer, is_expert: list[bool]
) -> None:
    """When experts differ across ranks, the expert entries of ``optimizer.state_dict()``
    (``is_expert`` by position) refuse plain DCP with a clear error (never silently
    mixed); ``fsdp_ckpt`` reads the live state instead."""

    def hook(_optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        states = state_dict["state"]
        for index, state in list(states.items()):
            if index < len(is_expert) and is_expert[index]:
                # A new dict: torch's state_dict() hands out the live per-parameter dicts.
                states[index] = {
                    key: _refuse_in_dcp(value, index) if isinstance(value, DTensor) else value
                    for key, value in state.items()
                }

    optimizer.register_state_dict_post_hook(hook)
