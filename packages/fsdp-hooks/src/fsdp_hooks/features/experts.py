"""Which parameters are expert (mixture-of-experts) parameters.

Expert parameters live on the expert mesh (``expt_device_mesh``): each expert-parallel
rank holds different experts, so they are sharded and reduced over the expert mesh's
data-parallel dims, in their own buckets, never with the dense ones. fsdp recognises
them, in this order:

1. a marker: ``mark_expert_params(module_or_params)`` (sets ``param._fsdp_expert``), or
   Megatron-Core's own marker ``param.allreduce = False``;
2. a name rule: ``DEFAULT_EXPERT_PATTERN`` (a regex searched in the parameter's
   qualified name, matching a module named ``experts`` at any depth, e.g.
   ``layers.3.mlp.experts.0.w1``);
3. or, replacing both, the ``is_expert_param(name, param) -> bool`` keyword argument of
   ``fully_shard`` / ``MegatronFSDP``. A string there is taken as the regex instead.

The default rule applies only when an expert mesh different from the dense one is
given; without one, experts are sharded like any parameter (expert parallelism 1).

State dicts name experts by their global index (``fsdp_hooks.features.expert_names``): an expert
parameter named ``<...>experts.<i>.`` in an ``nn.ModuleList`` gets ``ids[i]`` from
``local_expert_indices`` or ``expert_ids`` on that ModuleList or its nearest enclosing
module that has one, else ``ep_rank * num_local + i`` (Megatron-Core's convention, the
same ``num_local`` on every expert-parallel rank). Expert parameters named otherwise
(grouped 3-D weights) train as usual, but ``state_dict()`` raises NotImplementedError.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from torch import nn

__all__ = [
    "DEFAULT_EXPERT_PATTERN",
    "default_is_expert_param",
    "mark_expert_params",
    "resolve_is_expert_param",
]

DEFAULT_EXPERT_PATTERN = r"(^|\.)experts\."
EXPERT_ATTR = "_fsdp_expert"

ExpertRule = Callable[[str, nn.Parameter], bool]


def mark_expert_params(params: nn.Module | Iterable[nn.Parameter]) -> None:
    """Mark parameters (every parameter of a module) as expert parameters."""
    items = params.parameters() if isinstance(params, nn.Module) else params
    for p in items:
        setattr(p, EXPERT_ATTR, True)


def _marked(param: nn.Parameter) -> bool:
    return bool(getattr(param, EXPERT_ATTR, False)) or getattr(param, "allreduce", True) is False


def default_is_expert_param(name: str, param: nn.Parameter) -> bool:
    """The default rule: a marker, or ``DEFAULT_EXPERT_PATTERN`` in the name."""
    return _marked(param) or re.search(DEFAULT_EXPERT_PATTERN, name) is not None


def resolve_is_expert_param(
    rule: ExpertRule | str | None, has_expert_mesh: bool
) -> ExpertRule | None:
    """The rule to group parameters by: the given callable, a regex string (markers
    still count), the default when there is an expert mesh, else None."""
    if callable(rule):
        return rule
    if isinstance(rule, str):
        try:
            pattern = re.compile(rule)
        except re.error as err:
            raise ValueError(f"is_expert_param={rule!r} is not a valid regex: {err}") from err
        return lambda name, p: _marked(p) or pattern.search(name) is not None
    if rule is not None:
        raise TypeError(
            "is_expert_param must be a callable (name, param) -> bool, a regex string or "
            f"None; got {type(rule).__name__}"
        )
    return default_is_expert_param if has_expert_mesh else None
