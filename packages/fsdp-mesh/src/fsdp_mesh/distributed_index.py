"""FSDPDistributedIndex: which ranks each fsdp collective talks to.

The index turns a DeviceMesh plus the names of its data-parallel and tensor-parallel
dims into the process groups the buffer layer needs:

* the shard group (``dp_shard_dim``): parameters, gradients and optimizer state are
  sharded across it;
* the outer group (``dp_outer_dim``, hybrid sharding only): replicas of the shard
  group, or, with ``hsdp_outer_dp_shard``, a second level of sharding;
* the hybrid group: outer x shard flattened, i.e. every data-parallel rank;
* the tensor-parallel group (``tp_dim``);
* the same groups over the expert mesh, whose dims carry the same names.

Note [hybrid rank conventions]
Two rank orders over the hybrid group exist, and both are exposed:

* ``hybrid_fsdp_rank`` is this rank's index in ``hybrid_fsdp_group``. When the index
  builds that group by flattening ``mesh[dp_outer, dp_shard]`` it is outer-major:
  ``outer_rank * fsdp_size + fsdp_rank``.
* ``get_logical_hybrid_fsdp_rank()`` is the index of this rank's chunk when a buffer
  is sharded over both levels (``hsdp_outer_dp_shard``): sharded first across the
  shard group, then each shard piece across the outer group, so shard-major:
  ``fsdp_rank * outer_size + outer_rank``. A reduce-scatter over the shard group
  followed by one over the outer group leaves exactly that chunk on each rank.
  This is Megatron-FSDP's convention (its "(outer, inner) -> (inner, outer)" reorder).

Validation never issues a collective, so bad input raises the same ValueError on every
rank before any rank can block in a group creation the others never reach.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from fsdp_mesh.mesh_utils import get_mesh_names

__all__ = ["FSDPDistributedIndex"]


def _dim_mesh(mesh: DeviceMesh, name: str | None) -> DeviceMesh:
    """Return the 1-D mesh of dim ``name`` (a mesh dim, or a dim flattened on the root)."""
    if name is None:  # an unnamed 1-D mesh is its own shard dim
        return mesh
    if name in (mesh.mesh_dim_names or ()):
        return mesh[name]
    # Look flattened dims up directly: slicing them from the root is deprecated in torch.
    return mesh._get_root_mesh()._flatten_mapping[name]


def _check_dim(mesh: DeviceMesh, name: str, arg: str, which: str) -> None:
    available = get_mesh_names(mesh)
    if name not in available:
        raise ValueError(
            f"FSDPDistributedIndex: {arg}={name!r} is not a dim of the {which} "
            f"{mesh}; its dims (and flattened dims) are {available}."
        )


def _check_covers_world(mesh: DeviceMesh, which: str) -> None:
    world_size = dist.get_world_size()
    if mesh.size() != world_size:
        raise ValueError(
            f"FSDPDistributedIndex: the {which} {mesh} has {mesh.size()} ranks but the "
            f"world size is {world_size}; the mesh must cover every rank."
        )


def _flatten(mesh: DeviceMesh, outer: str, shard: str, name: str) -> DeviceMesh:
    """Flatten ``mesh[outer, shard]`` into one outer-major 1-D mesh (a collective)."""
    try:
        sub = mesh[(outer, shard)]
    except (KeyError, RuntimeError) as err:
        # Deterministic on every rank (it depends on the mesh only), so no rank hangs.
        raise ValueError(
            f"FSDPDistributedIndex: cannot build the hybrid group from dims "
            f"({outer!r}, {shard!r}) of {mesh}: the outer dim must come before the shard "
            "dim, and both must be dims of this mesh (or flattened dims of a root mesh). "
            f"Pass hybrid_fsdp_group explicitly otherwise. ({err})"
        ) from err
    if not hasattr(sub, "_flatten"):
        raise RuntimeError(
            "This torch's DeviceMesh has no _flatten(); pass hybrid_fsdp_group "
            "(and hybrid_fsdp_expt_group) explicitly for hybrid sharding."
        )
    return sub._flatten(name)


def _flattened_dim_of(mesh: DeviceMesh, group: ProcessGroup) -> DeviceMesh | None:
    """The 1-D mesh of a dim flattened on ``mesh``'s root whose group holds exactly
    ``group``'s ranks in ``group``'s order, or None. A local lookup (no collective):
    a hybrid group the caller flattened from the mesh is then a mesh dim too, which
    the DTensors of fully-sharded hybrid sharding with tensor parallelism need."""
    wanted = dist.get_process_group_ranks(group)
    flattened = getattr(mesh._get_root_mesh(), "_flatten_mapping", {})
    for sub in flattened.values():
        if sub.ndim == 1 and dist.get_process_group_ranks(sub.get_group()) == wanted:
            return sub
    return None


def _check_same_ranks(
    given: ProcessGroup | None, shard: ProcessGroup | None, arg: str, which: str
) -> None:
    """An independent all-gather group must hold exactly the shard group's ranks (a
    local check: no collective)."""
    if given is None or shard is None:
        return
    mine = dist.get_process_group_ranks(given)
    expected = dist.get_process_group_ranks(shard)
    if sorted(mine) != sorted(expected):
        raise ValueError(
            f"FSDPDistributedIndex: {arg} has ranks {mine} but the {which} group has "
            f"{expected}; an independent all-gather group must hold the same ranks"
        )


def _size_rank(group: ProcessGroup | None) -> tuple[int, int]:
    return (1, 0) if group is None else (group.size(), group.rank())


class FSDPDistributedIndex:
    """The process groups fsdp uses, looked up from a DeviceMesh by dim name.

    Args:
        device_mesh: mesh over every rank. Its dims are named, except that an unnamed
            1-D mesh may serve as the shard dim.
        dp_shard_dim: name of the dim parameters are sharded across (a mesh dim or a
            dim flattened on the root, e.g. ``"dp_cp"``). Defaults to the only dim of a
            1-D mesh; required for a mesh of more dims.
        dp_outer_dim: name of the outer data-parallel dim; giving it turns hybrid
            sharding (HSDP) on.
        tp_dim: name of the tensor-parallel dim, if any.
        hybrid_fsdp_group: the outer x shard group, when you already have it; by
            default it is made by flattening ``device_mesh[dp_outer_dim, dp_shard_dim]``.
        hsdp_outer_dp_shard: shard across the outer dim too (fully-sharded HSDP).
        expt_device_mesh: mesh for expert (MoE) parameters, with the same dim names
            (``tp_dim`` may be absent there: expert TP of size 1); defaults to
            ``device_mesh`` (expert parallelism of size 1).
        hybrid_fsdp_expt_group: the expert outer x shard group, when you already have it.
        fsdp_group_ag, expt_fsdp_group_ag: Megatron-FSDP's independent all-gather
            groups (the same ranks as the (expert) shard group, a second communicator
            so that gathers can overlap reductions on NCCL). Kept and returned by
            ``get_fsdp_group(..., independent_all_gather=True)``; fsdp's own gathers
            use the shard group. Their ranks must be the shard group's.
        part_of_world: the meshes span only part of the world, e.g. one data-parallel
            group beside tensor or pipeline groups that fsdp does not manage (each rank
            passes its own). Off by default, so that a sub-mesh passed by mistake (the
            ``dp`` dim of a mesh whose other dims fsdp should know) is an error.

    See Note [hybrid rank conventions] in this module for the two hybrid rank orders.
    """

    def __init__(
        self,
        device_mesh: DeviceMesh,
        dp_shard_dim: str | None = None,
        dp_outer_dim: str | None = None,
        tp_dim: str | None = None,
        hybrid_fsdp_group: ProcessGroup | None = None,
        hybrid_fsdp_expt_group: ProcessGroup | None = None,
        hsdp_outer_dp_shard: bool = False,
        expt_device_mesh: DeviceMesh | None = None,
        fsdp_group_ag: ProcessGroup | None = None,
        expt_fsdp_group_ag: ProcessGroup | None = None,
        *,
        part_of_world: bool = False,
    ) -> None:
        dp_shard_dim = self._validate(
            device_mesh, dp_shard_dim, dp_outer_dim, tp_dim, hybrid_fsdp_group,
            hsdp_outer_dp_shard, expt_device_mesh, hybrid_fsdp_expt_group, part_of_world,
        )  # fmt: skip
        self.device_mesh = device_mesh
        # None without an expert mesh, as in Megatron-FSDP; expert parameters then use
        # the dense groups (expert parallelism of size 1).
        self.expt_device_mesh = expt_device_mesh
        self.dp_shard_dim = dp_shard_dim
        self.dp_outer_dim = dp_outer_dim
        self.tp_dim = tp_dim
        self.use_hybrid_fsdp = dp_outer_dim is not None
        self.hsdp_outer_dp_shard = hsdp_outer_dp_shard
        self.device_type = device_mesh.device_type
        self._submeshes: dict[tuple[tuple[str, ...], bool], DeviceMesh] = {}

        # Dense groups. get_group() on an existing mesh dim issues no collective.
        self.fsdp_mesh = _dim_mesh(device_mesh, dp_shard_dim)
        self.fsdp_group = self.fsdp_mesh.get_group()
        self.outer_fsdp_mesh = _dim_mesh(device_mesh, dp_outer_dim) if dp_outer_dim else None
        self.outer_fsdp_group = self.outer_fsdp_mesh.get_group() if self.outer_fsdp_mesh else None
        self.tp_mesh = _dim_mesh(device_mesh, tp_dim) if tp_dim else None
        self.tp_group = self.tp_mesh.get_group() if self.tp_mesh else None
        self.hybrid_fsdp_mesh: DeviceMesh | None = None
        if self.use_hybrid_fsdp and hybrid_fsdp_group is None:
            assert dp_outer_dim is not None and dp_shard_dim is not None  # by _validate
            self.hybrid_fsdp_mesh = _flatten(
                device_mesh, dp_outer_dim, dp_shard_dim, f"{dp_outer_dim}_{dp_shard_dim}"
            )
            hybrid_fsdp_group = self.hybrid_fsdp_mesh.get_group()
        elif self.use_hybrid_fsdp and hybrid_fsdp_group is not None:
            self.hybrid_fsdp_mesh = _flattened_dim_of(device_mesh, hybrid_fsdp_group)
        self.hybrid_fsdp_group = hybrid_fsdp_group

        # Expert groups, from the expert mesh under the same dim names.
        expt = self.get_root_mesh(is_expert_parallel=True)
        expt_has_tp = tp_dim is not None and tp_dim in get_mesh_names(expt)
        if expt is device_mesh:
            self.expt_fsdp_group = self.fsdp_group
            self.expt_outer_fsdp_group = self.outer_fsdp_group
            self.expt_tp_group = self.tp_group
            if hybrid_fsdp_expt_group is None:
                hybrid_fsdp_expt_group = self.hybrid_fsdp_group
        else:
            self.expt_fsdp_group = _dim_mesh(expt, dp_shard_dim).get_group()
            self.expt_outer_fsdp_group = (
                _dim_mesh(expt, dp_outer_dim).get_group() if dp_outer_dim else None
            )
            self.expt_tp_group = _dim_mesh(expt, tp_dim).get_group() if expt_has_tp else None
            if self.use_hybrid_fsdp and hybrid_fsdp_expt_group is None:
                assert dp_outer_dim is not None and dp_shard_dim is not None  # by _validate
                # Flattened names live on the root: keep clear of the dense one if shared.
                shared_root = expt._get_root_mesh() is device_mesh._get_root_mesh()
                name = f"{'expt_' if shared_root else ''}{dp_outer_dim}_{dp_shard_dim}"
                hybrid_fsdp_expt_group = _flatten(
                    expt, dp_outer_dim, dp_shard_dim, name
                ).get_group()
        self.hybrid_fsdp_expt_group = hybrid_fsdp_expt_group

        # Sizes and ranks, for the buffer layer's arithmetic.
        self.fsdp_size, self.fsdp_rank = _size_rank(self.fsdp_group)
        self.outer_size, self.outer_rank = _size_rank(self.outer_fsdp_group)
        self.tp_size, self.tp_rank = _size_rank(self.tp_group)
        self.dp_size, self.dp_rank = _size_rank(self.get_dp_group())
        self.hybrid_fsdp_rank = self.hybrid_fsdp_group.rank() if self.hybrid_fsdp_group else None
        self.expt_fsdp_size, self.expt_fsdp_rank = _size_rank(self.expt_fsdp_group)
        self.expt_outer_size, self.expt_outer_rank = _size_rank(self.expt_outer_fsdp_group)
        self.expt_tp_size, self.expt_tp_rank = _size_rank(self.expt_tp_group)
        self.expt_dp_size, self.expt_dp_rank = _size_rank(self.get_dp_group(True))
        self._check_group_sizes()
        _check_same_ranks(fsdp_group_ag, self.fsdp_group, "fsdp_group_ag", "dp_shard")
        _check_same_ranks(
            expt_fsdp_group_ag, self.expt_fsdp_group, "expt_fsdp_group_ag", "expert dp_shard"
        )
        self.fsdp_group_ag = fsdp_group_ag
        self.expt_fsdp_group_ag = expt_fsdp_group_ag

    @staticmethod
    def _validate(
        mesh: DeviceMesh,
        dp_shard_dim: str | None,
        dp_outer_dim: str | None,
        tp_dim: str | None,
        hybrid_fsdp_group: ProcessGroup | None,
        hsdp_outer_dp_shard: bool,
        expt_mesh: DeviceMesh | None,
        hybrid_fsdp_expt_group: ProcessGroup | None,
        part_of_world: bool,
    ) -> str | None:
        """Check every argument on local information only; return the resolved shard dim."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "FSDPDistributedIndex needs an initialised default process group; call "
                "torch.distributed.init_process_group first."
            )
        for value, arg in ((mesh, "device_mesh"), (expt_mesh, "expt_device_mesh")):
            if value is not None and not isinstance(value, DeviceMesh):
                raise TypeError(
                    f"FSDPDistributedIndex: {arg} must be a torch DeviceMesh; got "
                    f"{type(value).__name__}."
                )
        if not part_of_world:
            _check_covers_world(mesh, "device_mesh")
        names = list(mesh.mesh_dim_names or ())
        if dp_shard_dim is None:
            if mesh.ndim != 1:
                raise ValueError(
                    f"FSDPDistributedIndex: dp_shard_dim is required for the {mesh.ndim}-D "
                    f"device_mesh {mesh}; pick one of its dims {get_mesh_names(mesh)}."
                )
            dp_shard_dim = names[0] if names else None
        dims = {"dp_shard_dim": dp_shard_dim, "dp_outer_dim": dp_outer_dim, "tp_dim": tp_dim}
        given = {arg: name for arg, name in dims.items() if name is not None}
        for arg, name in given.items():
            _check_dim(mesh, name, arg, "device_mesh")
        if len(set(given.values())) != len(given):
            raise ValueError(
                f"FSDPDistributedIndex: dp_shard_dim, dp_outer_dim and tp_dim must name "
                f"different dims; got {given}."
            )
        if dp_outer_dim is None:
            if hsdp_outer_dp_shard:
                raise ValueError(
                    "FSDPDistributedIndex: hsdp_outer_dp_shard=True shards across the outer "
                    "data-parallel dim, but dp_outer_dim is None; pass dp_outer_dim (one of "
                    f"{get_mesh_names(mesh)}) or set hsdp_outer_dp_shard=False."
                )
            for group, arg in (
                (hybrid_fsdp_group, "hybrid_fsdp_group"),
                (hybrid_fsdp_expt_group, "hybrid_fsdp_expt_group"),
            ):
                if group is not None:
                    raise ValueError(
                        f"FSDPDistributedIndex: {arg} was given but dp_outer_dim is None, so "
                        "hybrid sharding is off and the group would be ignored; pass "
                        "dp_outer_dim to turn hybrid sharding on, or drop the group."
                    )
        if expt_mesh is not None:
            if not part_of_world:
                _check_covers_world(expt_mesh, "expt_device_mesh")
            if dp_shard_dim is None and expt_mesh.ndim != 1:
                raise ValueError(
                    "FSDPDistributedIndex: device_mesh is an unnamed 1-D mesh, so "
                    f"expt_device_mesh must be 1-D too; it is {expt_mesh}."
                )
            if dp_shard_dim is not None:
                _check_dim(expt_mesh, dp_shard_dim, "dp_shard_dim", "expt_device_mesh")
            if dp_outer_dim is not None:
                _check_dim(expt_mesh, dp_outer_dim, "dp_outer_dim", "expt_device_mesh")
        return dp_shard_dim

    def _check_group_sizes(self) -> None:
        for group, outer, shard, arg in (
            (self.hybrid_fsdp_group, self.outer_size, self.fsdp_size, "hybrid_fsdp_group"),
            (self.hybrid_fsdp_expt_group, self.expt_outer_size, self.expt_fsdp_size,
             "hybrid_fsdp_expt_group"),
        ):  # fmt: skip
            if group is not None and group.size() != outer * shard:
                raise ValueError(
                    f"FSDPDistributedIndex: {arg} has {group.size()} ranks, but the outer "
                    f"({outer}) x shard ({shard}) dims hold {outer * shard}; it must be their "
                    "flattened product."
                )

    # -- lookups ---------------------------------------------------------------------

    def get_submesh(
        self, mesh_dim_names: str | Sequence[str], is_expert_parallel: bool = False
    ) -> DeviceMesh:
        """Return the sub-mesh of the (expert) mesh spanning ``mesh_dim_names``, in mesh order."""
        names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        key = (names, is_expert_parallel)
        if key not in self._submeshes:
            mesh = self.get_root_mesh(is_expert_parallel)
            which = "expt_device_mesh" if is_expert_parallel else "device_mesh"
            available = get_mesh_names(mesh)
            missing = [n for n in names if n not in available]
            if not names or missing:
                raise ValueError(
                    f"FSDPDistributedIndex.get_submesh: {list(names)} is not a sub-mesh of "
                    f"the {which} {mesh} (unknown: {missing}); its dims are {available}."
                )
            try:
                sub = _dim_mesh(mesh, names[0]) if len(names) == 1 else mesh[names]
            except (KeyError, RuntimeError) as err:
                raise ValueError(
                    f"FSDPDistributedIndex.get_submesh: cannot slice {list(names)} from the "
                    f"{which} {mesh}; name dims in mesh order, from {available}. ({err})"
                ) from err
            self._submeshes[key] = sub
        return self._submeshes[key]

    def get_dp_group(self, is_expert_parallel: bool = False) -> ProcessGroup:
        """Return every data-parallel rank: the hybrid group when hybrid, else the shard group."""
        if is_expert_parallel:
            group = self.hybrid_fsdp_expt_group if self.use_hybrid_fsdp else self.expt_fsdp_group
        else:
            group = self.hybrid_fsdp_group if self.use_hybrid_fsdp else self.fsdp_group
        assert group is not None  # guaranteed by __init__
        return group

    def get_fsdp_group(
        self, is_expert_parallel: bool = False, independent_all_gather: bool = False
    ) -> ProcessGroup | None:
        """Return the shard group (the expert one with ``is_expert_parallel``); with
        ``independent_all_gather``, the all-gather group given for it (None if none
        was given, as in Megatron-FSDP)."""
        if independent_all_gather:
            return self.expt_fsdp_group_ag if is_expert_parallel else self.fsdp_group_ag
        group = self.expt_fsdp_group if is_expert_parallel else self.fsdp_group
        assert group is not None  # guaranteed by __init__
        return group

    def get_outer_fsdp_group(self, is_expert_parallel: bool = False) -> ProcessGroup | None:
        """Return the outer data-parallel group, or None when hybrid sharding is off."""
        if not self.use_hybrid_fsdp:
            return None
        return self.expt_outer_fsdp_group if is_expert_parallel else self.outer_fsdp_group

    @property
    def expt_dp_group(self) -> ProcessGroup:
        """Every expert data-parallel rank (``get_dp_group(is_expert_parallel=True)``)."""
        return self.get_dp_group(is_expert_parallel=True)

    def get_root_mesh(self, is_expert_parallel: bool = False) -> DeviceMesh:
        """Return the mesh this index was built from (not DeviceMesh's own root mesh);
        for experts without an expert mesh, the dense one."""
        if is_expert_parallel and self.expt_device_mesh is not None:
            return self.expt_device_mesh
        return self.device_mesh

    @property
    def has_expert_mesh(self) -> bool:
        """Whether experts have a mesh of their own (``expt_device_mesh`` given and
        not the dense mesh); without one they use the dense groups."""
        return self.expt_device_mesh is not None and self.expt_device_mesh is not self.device_mesh

    def get_logical_hybrid_fsdp_rank(self, is_expert_parallel: bool = False) -> int:
        """Return this rank's chunk index under fully-sharded HSDP.

        ``fsdp_rank * outer_size + outer_rank``: buffers are sharded across the shard
        group first, then across the outer group. See Note [hybrid rank conventions].
        """
        if not self.hsdp_outer_dp_shard:
            raise ValueError(
                "FSDPDistributedIndex.get_logical_hybrid_fsdp_rank is only defined when "
                "fully-sharded hybrid FSDP is on (hsdp_outer_dp_shard=True with a "
                f"dp_outer_dim); this index has hsdp_outer_dp_shard=False and "
                f"dp_outer_dim={self.dp_outer_dim!r}."
            )
        if is_expert_parallel:
            return self.expt_fsdp_rank * self.expt_outer_size + self.expt_outer_rank
        return self.fsdp_rank * self.outer_size + self.outer_rank

    def __repr__(self) -> str:
        return (
            f"FSDPDistributedIndex(device_mesh={self.device_mesh}, dp_shard_dim="
            f"{self.dp_shard_dim!r}, dp_outer_dim={self.dp_outer_dim!r}, tp_dim="
            f"{self.tp_dim!r}, hsdp_outer_dp_shard={self.hsdp_outer_dp_shard}, fsdp_size="
            f"{self.fsdp_size}, outer_size={self.outer_size}, tp_size={self.tp_size})"
        )
