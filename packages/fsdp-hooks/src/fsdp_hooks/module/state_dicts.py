"""``MegatronFSDP``'s state dicts: the wrapped module's own, under its own names, with
experts under their global index when experts differ across ranks (``expert_names``) and
whole-placed parameters seen through their row placement (``whole_state``).

The wrapper's ``state_dict`` / ``load_state_dict`` call these with what they read: the
hooks (to put the distributed parameters in place), the wrapped module and the expert
names built at wrap time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from fsdp_buffers import ParamAndGradBuffer
from fsdp_hooks.features.expert_names import ExpertStateNames
from fsdp_hooks.features.whole_state import row_placed_whole_params
from fsdp_hooks.runtime.hooks import FSDPHooks

__all__ = ["check_checkpointable", "expert_state_names", "load_state_dict", "state_dict"]


def expert_state_names(
    buffer: ParamAndGradBuffer,
    module: nn.Module,
    dist_index,  # fsdp_mesh.FSDPDistributedIndex
    experts_differ_across_ranks: bool,
) -> ExpertStateNames:
    """Local <-> global expert names for state dicts when experts differ across
    ranks (see ``expert_names``); a collective then, as wrapping is."""
    experts = [n for g in buffer.groups if g.is_expert_param for n in g.names]
    if not experts_differ_across_ranks or not experts:
        return ExpertStateNames()
    names = ExpertStateNames.build(module, experts, dist_index)
    names.tag(module)
    return names


def check_checkpointable(names: ExpertStateNames) -> None:
    """Raise (a fresh copy of) the error that made the expert names unusable, if any."""
    if names.error is not None:
        raise type(names.error)(*names.error.args)


def state_dict(
    hooks: FSDPHooks, module: nn.Module, names: ExpertStateNames, args: tuple, kwargs: dict
) -> dict[str, Any]:
    """``module.state_dict(*args, **kwargs)`` over the distributed parameters, experts
    renamed to their global index."""
    check_checkpointable(names)
    hooks.swap.use_distributed_params()
    with row_placed_whole_params(hooks, load=False):
        sd = module.state_dict(*args, **kwargs)
    if names.ids:
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        items = list(sd.items())
        sd.clear()  # renamed in place: a parent's state_dict passes its own dict
        for key, value in items:
            if key.startswith(prefix):
                key = prefix + names.to_global(key[len(prefix) :])
            sd[key] = value
    return sd


def load_state_dict(
    hooks: FSDPHooks,
    module: nn.Module,
    names: ExpertStateNames,
    state_dict: Any,
    strict: bool,
    assign: bool,
    install_main_weights: Callable[[], None],
) -> Any:
    """``module.load_state_dict`` into the distributed parameters (experts named as
    ``state_dict`` names them; other ranks' experts are unexpected keys), then
    ``install_main_weights()`` to refresh the compute weights."""
    check_checkpointable(names)
    hooks.swap.use_distributed_params()
    if not names.ids:
        with row_placed_whole_params(hooks, load=True):
            result = module.load_state_dict(state_dict, strict=strict, assign=assign)
        install_main_weights()
        return result
    local: dict[str, Any] = OrderedDict()
    foreign: list[str] = []
    for key, value in state_dict.items():
        mine = names.to_local(key)
        if mine is None:
            foreign.append(key)
        else:
            local[mine] = value
    local._metadata = getattr(state_dict, "_metadata", None)  # type: ignore[attr-defined]
    with row_placed_whole_params(hooks, load=True):
        result = module.load_state_dict(local, strict=False, assign=assign)
    missing = [names.to_global(k) for k in result.missing_keys]
    unexpected = [*result.unexpected_keys, *foreign]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}: "
            f"missing keys {missing}, unexpected keys {unexpected} (experts under their "
            f"global index; this rank holds {names.ids})"
        )
    install_main_weights()
    return _IncompatibleKeys(missing, unexpected)
