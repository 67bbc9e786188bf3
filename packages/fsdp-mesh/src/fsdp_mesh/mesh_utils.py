"""Small helpers around DeviceMesh and modules, and a builder for fsdp's standard meshes."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_mesh.device import default_device_type

__all__ = [
    "DP_OUTER_DIM",
    "DP_SHARD_DIM",
    "EP_DIM",
    "TP_DIM",
    "FSDPMeshes",
    "build_device_mesh",
    "contains_submesh",
    "create_updated_function_signature",
    "get_mesh_names",
    "is_submodule",
]

# Dim names of the meshes build_device_mesh makes; the expert mesh reuses the dense
# names so that one set of dim names (dp_shard_dim, dp_outer_dim, tp_dim) indexes both.
DP_OUTER_DIM = "dp_outer"
DP_SHARD_DIM = "dp_shard"
TP_DIM = "tp"
EP_DIM = "ep"


def get_mesh_names(
    device_mesh: DeviceMesh | None = None, only_submesh_dims: bool = False
) -> list[str]:
    """Return the mesh's dim names, then the names of flattened dims on its root mesh.

    Sub-mesh dims come first in mesh order; unless ``only_submesh_dims``, the names of
    meshes flattened from the root (``mesh["dp", "cp"]._flatten("dp_cp")``) follow, when
    this torch still records them on the root mesh. No mesh gives ``[]``.
    """
    if device_mesh is None:
        return []
    names = list(device_mesh.mesh_dim_names or ())
    if only_submesh_dims:
        return names
    root = device_mesh._get_root_mesh()
    flattened = getattr(root, "_flatten_mapping", {}) or {}
    return names + [name for name in flattened if name not in names]


def contains_submesh(
    device_mesh: DeviceMesh | None, submesh_names: str | Sequence[str] | None
) -> bool:
    """Return whether every name in ``submesh_names`` is a dim (or flattened dim) of the mesh."""
    if device_mesh is None or submesh_names is None:
        return False
    if isinstance(submesh_names, str):
        submesh_names = (submesh_names,)
    available = get_mesh_names(device_mesh)
    return all(name in available for name in submesh_names)


def is_submodule(module: nn.Module, parent_module: nn.Module, strict: bool = True) -> bool:
    """Return whether ``module`` is inside ``parent_module``; with ``strict``, not the parent itself."""
    if strict and module is parent_module:
        return False
    return any(m is module for m in parent_module.modules())


def create_updated_function_signature(
    original_function: Callable[..., Any], **extended_kwargs: Any
) -> inspect.Signature:
    """Return ``original_function``'s signature with ``extended_kwargs`` added as keyword-only.

    Each new parameter gets its value as default and, unless None, its type as annotation.
    The result is meant for ``wrapper.__signature__``, so that a patched method (say an
    optimizer's ``step`` taking extra fsdp options) reports its full signature to
    ``inspect.signature`` and to IDEs. New parameters go before any ``**kwargs``.
    """
    params = list(inspect.signature(original_function).parameters.values())
    existing = {p.name for p in params}
    clashes = sorted(existing.intersection(extended_kwargs))
    if clashes:
        raise ValueError(
            f"Cannot add keyword-only parameters {clashes} to {original_function!r}: its "
            f"signature already has parameters named {sorted(existing)}."
        )
    var_kw = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    params = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    for name, default in extended_kwargs.items():
        annotation = type(default) if default is not None else inspect.Parameter.empty
        params.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
            )
        )
    return inspect.Signature(params + var_kw)


@dataclass(frozen=True)
class FSDPMeshes:
    """The meshes build_device_mesh made.

    ``device_mesh`` always has the three dims ``("dp_outer", "dp_shard", "tp")`` in that
    order, size-1 dims included, so code can name a dim without asking whether it
    exists. ``expt_device_mesh`` (when expert parallelism was asked for) has
    ``("dp_outer", "dp_shard", "ep", "tp")``: the dense ``dp_shard`` dim split into
    ``dp_shard // ep`` expert data-parallel ranks times ``ep`` expert-parallel ranks,
    so that ``FSDPDistributedIndex`` finds the expert shard group under the same name.
    """

    device_mesh: DeviceMesh
    expt_device_mesh: DeviceMesh | None = None

    def fsdp_kwargs(self, hybrid: bool | None = None) -> dict[str, Any]:
        """Keyword arguments for ``FSDPDistributedIndex`` / ``fully_shard`` over these meshes.

        ``hybrid`` (default: whether ``dp_outer`` > 1) decides whether ``dp_outer_dim``
        is passed, i.e. whether the outer dim is used for hybrid sharding.
        """
        if hybrid is None:
            hybrid = self.device_mesh.size(0) > 1
        return {
            "device_mesh": self.device_mesh,
            "dp_shard_dim": DP_SHARD_DIM,
            "dp_outer_dim": DP_OUTER_DIM if hybrid else None,
            "tp_dim": TP_DIM,
            "expt_device_mesh": self.expt_device_mesh,
        }


def _check_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"build_device_mesh: {name} must be a positive int; got {value!r}.")
    return value


def build_device_mesh(
    *,
    dp_shard: int,
    dp_outer: int = 1,
    tp: int = 1,
    expert_parallel: int | None = None,
    device_type: str | None = None,
) -> FSDPMeshes:
    """Build fsdp's standard meshes over the whole world; every rank must call it.

    Ranks are laid out row-major over ``(dp_outer, dp_shard, tp)``: tensor-parallel
    ranks are adjacent (on one node), then the shard group, then the replicas.
    ``expert_parallel`` (a divisor of ``dp_shard``) adds the expert mesh described in
    :class:`FSDPMeshes`. The sizes must multiply to the world size.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "build_device_mesh needs an initialised default process group; call "
            "torch.distributed.init_process_group first."
        )
    sizes = {
        "dp_outer": _check_size("dp_outer", dp_outer),
        "dp_shard": _check_size("dp_shard", dp_shard),
        "tp": _check_size("tp", tp),
    }
    world_size = dist.get_world_size()
    if math.prod(sizes.values()) != world_size:
        shown = " * ".join(f"{k}={v}" for k, v in sizes.items())
        raise ValueError(
            f"build_device_mesh: {shown} = {math.prod(sizes.values())} ranks, but the world "
            f"size is {world_size}; the sizes must multiply to the world size."
        )
    if expert_parallel is not None:
        _check_size("expert_parallel", expert_parallel)
        if dp_shard % expert_parallel != 0:
            raise ValueError(
                f"build_device_mesh: expert_parallel={expert_parallel} must divide "
                f"dp_shard={dp_shard}, since expert-parallel ranks are carved out of the "
                f"shard dim; valid values are "
                f"{[d for d in range(1, dp_shard + 1) if dp_shard % d == 0]}."
            )
    device_type = device_type or default_device_type()
    mesh = init_device_mesh(
        device_type, (dp_outer, dp_shard, tp), mesh_dim_names=(DP_OUTER_DIM, DP_SHARD_DIM, TP_DIM)
    )
    expt_mesh = None
    if expert_parallel is not None:
        # A separate root mesh: its dims reuse the dense names with other layouts, which
        # could not be registered (e.g. flattened) on the dense root side by side.
        expt_mesh = init_device_mesh(
            device_type,
            (dp_outer, dp_shard // expert_parallel, expert_parallel, tp),
            mesh_dim_names=(DP_OUTER_DIM, DP_SHARD_DIM, EP_DIM, TP_DIM),
        )
    return FSDPMeshes(mesh, expt_mesh)
