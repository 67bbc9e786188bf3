"""FSDPDistributedIndex and build_device_mesh on 1, 2 and 4 ranks (4 as a 2 x 2 mesh).

Each world size runs one distributed function that checks everything on every rank;
bad input must raise the same ValueError on every rank.
"""

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_mesh import (
    FSDPDistributedIndex,
    build_device_mesh,
    contains_submesh,
    get_mesh_names,
)
from fsdp_mesh.testing import run_distributed


def _ranks(group):
    return dist.get_process_group_ranks(group)


def _world_1():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (1,))  # unnamed 1-D: the whole mesh is the shard dim
    index = FSDPDistributedIndex(mesh)
    assert index.dp_shard_dim is None and index.device_type == "cpu"
    assert _ranks(index.get_fsdp_group()) == _ranks(index.get_dp_group()) == [rank]
    assert (index.fsdp_size, index.fsdp_rank, index.dp_size, index.tp_size) == (1, 0, 1, 1)
    assert index.get_outer_fsdp_group() is None and index.tp_group is None
    assert not index.use_hybrid_fsdp and index.hybrid_fsdp_group is None
    assert index.get_root_mesh() is mesh and index.get_root_mesh(True) is mesh
    assert index.get_fsdp_group(is_expert_parallel=True) is index.fsdp_group
    with pytest.raises(ValueError, match=r"only defined when fully-sharded hybrid FSDP is on"):
        index.get_logical_hybrid_fsdp_rank()

    meshes = build_device_mesh(dp_shard=1, device_type="cpu")
    assert meshes.device_mesh.mesh_dim_names == ("dp_outer", "dp_shard", "tp")
    assert meshes.device_mesh.shape == (1, 1, 1) and meshes.expt_device_mesh is None
    kwargs = meshes.fsdp_kwargs()
    assert kwargs["dp_outer_dim"] is None and kwargs["dp_shard_dim"] == "dp_shard"
    assert meshes.fsdp_kwargs(hybrid=True)["dp_outer_dim"] == "dp_outer"
    hybrid = FSDPDistributedIndex(**meshes.fsdp_kwargs(hybrid=True), hsdp_outer_dp_shard=True)
    assert hybrid.get_logical_hybrid_fsdp_rank() == 0 and hybrid.hybrid_fsdp_rank == 0

    with pytest.raises(
        ValueError, match=r"dp_outer=1 \* dp_shard=2 \* tp=1 = 2 ranks, but the world size is 1"
    ):
        build_device_mesh(dp_shard=2, device_type="cpu")
    with pytest.raises(ValueError, match=r"tp must be a positive int; got 0"):
        build_device_mesh(dp_shard=1, tp=0, device_type="cpu")
    with pytest.raises(ValueError, match=r"expert_parallel=2 must divide dp_shard=1.*\[1\]"):
        build_device_mesh(dp_shard=1, expert_parallel=2, device_type="cpu")
    with pytest.raises(TypeError, match="device_mesh must be a torch DeviceMesh; got str"):
        FSDPDistributedIndex("dp")
    return rank


def _world_2():
    rank = dist.get_rank()
    # A named 1-D mesh: dp_shard_dim defaults to its one dim.
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    index = FSDPDistributedIndex(mesh)
    assert index.dp_shard_dim == "dp"
    assert _ranks(index.get_fsdp_group()) == _ranks(index.get_dp_group()) == [0, 1]
    assert (index.fsdp_size, index.fsdp_rank) == (2, rank)
    assert index.get_submesh("dp") is index.get_submesh(("dp",))
    assert index.get_submesh("dp").mesh.tolist() == [0, 1]

    # Pure replication across the outer dim (HSDP with a shard group of one).
    meshes = build_device_mesh(dp_shard=1, dp_outer=2, device_type="cpu")
    hsdp = FSDPDistributedIndex(**meshes.fsdp_kwargs(), hsdp_outer_dp_shard=True)
    assert hsdp.use_hybrid_fsdp
    assert _ranks(hsdp.get_fsdp_group()) == [rank]
    assert _ranks(hsdp.get_outer_fsdp_group()) == [0, 1]
    assert _ranks(hsdp.get_dp_group()) == [0, 1] and hsdp.dp_size == 2
    assert (hsdp.outer_size, hsdp.outer_rank) == (2, rank)
    assert hsdp.get_logical_hybrid_fsdp_rank() == rank
    # An explicitly given hybrid group is used as is (no flattening); the dim flattened
    # earlier with the same ranks in the same order is its mesh (for tp's DTensors).
    given = FSDPDistributedIndex(**meshes.fsdp_kwargs(), hybrid_fsdp_group=hsdp.outer_fsdp_group)
    assert given.hybrid_fsdp_group is hsdp.outer_fsdp_group
    assert given.hybrid_fsdp_mesh is hsdp.hybrid_fsdp_mesh is not None

    # Expert parallelism 2 carved out of the shard dim.
    ep = build_device_mesh(dp_shard=2, expert_parallel=2, device_type="cpu")
    assert ep.expt_device_mesh.mesh_dim_names == ("dp_outer", "dp_shard", "ep", "tp")
    eindex = FSDPDistributedIndex(**ep.fsdp_kwargs())
    assert _ranks(eindex.get_fsdp_group()) == [0, 1]
    assert _ranks(eindex.get_fsdp_group(is_expert_parallel=True)) == [rank]
    assert _ranks(eindex.expt_dp_group) == [rank] and eindex.expt_dp_size == 1
    assert eindex.get_submesh("ep", is_expert_parallel=True).mesh.tolist() == [0, 1]
    assert eindex.get_root_mesh(True) is ep.expt_device_mesh
    assert _ranks(eindex.expt_tp_group) == [rank]

    # A mesh that leaves a rank out.
    small = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    with pytest.raises(
        ValueError, match=r"has 1 ranks but the world size is 2; the mesh must cover every rank"
    ):
        FSDPDistributedIndex(small)
    with pytest.raises(
        ValueError, match=r"expt_device_mesh .* has 1 ranks but the world size is 2"
    ):
        FSDPDistributedIndex(mesh, expt_device_mesh=small)
    # ... unless it is said to be part of the world (a data-parallel group beside others).
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())]
    own = DeviceMesh.from_group(solo[rank], "cpu", mesh_dim_names=("dp",))
    part = FSDPDistributedIndex(own, part_of_world=True)
    assert part.fsdp_size == 1 and _ranks(part.get_fsdp_group()) == [rank]
    with pytest.raises(ValueError, match=r"hybrid_fsdp_group was given but dp_outer_dim is None"):
        FSDPDistributedIndex(mesh, hybrid_fsdp_group=index.fsdp_group)
    with pytest.raises(
        ValueError,
        match=r"hybrid_fsdp_group has 1 ranks, but the outer \(2\) x shard \(1\) dims hold 2",
    ):
        FSDPDistributedIndex(**meshes.fsdp_kwargs(), hybrid_fsdp_group=hsdp.fsdp_group)
    return rank


def _world_4():
    rank = dist.get_rank()
    outer, shard = divmod(rank, 2)  # row-major over (dp_outer, dp_shard)
    meshes = build_device_mesh(dp_shard=2, dp_outer=2, expert_parallel=2, device_type="cpu")
    mesh, expt = meshes.device_mesh, meshes.expt_device_mesh
    index = FSDPDistributedIndex(**meshes.fsdp_kwargs(), hsdp_outer_dp_shard=True)
    assert index.use_hybrid_fsdp and index.dp_outer_dim == "dp_outer"
    assert _ranks(index.get_fsdp_group()) == [2 * outer, 2 * outer + 1]
    assert _ranks(index.get_outer_fsdp_group()) == [shard, shard + 2]
    assert _ranks(index.get_dp_group()) == _ranks(index.hybrid_fsdp_group) == [0, 1, 2, 3]
    assert (index.fsdp_size, index.fsdp_rank, index.outer_size, index.outer_rank) == (
        2,
        shard,
        2,
        outer,
    )
    assert (index.dp_size, index.dp_rank, index.tp_size, index.tp_rank) == (4, rank, 1, 0)
    # Group rank is outer-major; the logical (chunk) rank is shard-major.
    assert index.hybrid_fsdp_rank == rank == outer * 2 + shard
    assert index.get_logical_hybrid_fsdp_rank() == shard * 2 + outer
    assert index.hybrid_fsdp_mesh.mesh_dim_names == ("dp_outer_dp_shard",)

    # Submeshes, and mesh names including the flattened hybrid dim.
    assert index.get_submesh(("dp_outer", "dp_shard")).mesh.tolist() == [[0, 1], [2, 3]]
    assert index.get_submesh("tp").mesh.tolist() == [rank]
    assert index.get_submesh("dp_outer_dp_shard").mesh.tolist() == [0, 1, 2, 3]
    assert get_mesh_names(mesh) == ["dp_outer", "dp_shard", "tp", "dp_outer_dp_shard"]
    assert get_mesh_names(mesh, only_submesh_dims=True) == ["dp_outer", "dp_shard", "tp"]
    assert contains_submesh(mesh, ("dp_outer", "dp_outer_dp_shard"))
    assert contains_submesh(mesh, "tp") and not contains_submesh(mesh, ("tp", "ep"))
    assert not contains_submesh(mesh, None)
    with pytest.raises(
        ValueError, match=r"\['ep'\] is not a sub-mesh of the device_mesh .*unknown: \['ep'\]"
    ):
        index.get_submesh("ep")
    with pytest.raises(ValueError, match=r"cannot slice \['dp_shard', 'dp_outer'\].*mesh order"):
        index.get_submesh(("dp_shard", "dp_outer"))

    # Expert groups: expert mesh (dp_outer=2, dp_shard=1, ep=2, tp=1), rank = outer*2 + ep.
    ep_rank = rank % 2
    assert _ranks(index.get_fsdp_group(is_expert_parallel=True)) == [rank]
    assert _ranks(index.get_outer_fsdp_group(is_expert_parallel=True)) == [ep_rank, ep_rank + 2]
    assert _ranks(index.get_dp_group(is_expert_parallel=True)) == [ep_rank, ep_rank + 2]
    assert _ranks(index.expt_dp_group) == [ep_rank, ep_rank + 2]
    assert (index.expt_dp_size, index.expt_fsdp_size, index.expt_outer_size) == (2, 1, 2)
    assert index.get_logical_hybrid_fsdp_rank(is_expert_parallel=True) == outer
    assert index.get_submesh("ep", is_expert_parallel=True).mesh.tolist() == [
        2 * outer,
        2 * outer + 1,
    ]
    assert index.get_root_mesh(is_expert_parallel=True) is expt

    # A 2 x 2 (dp, tp) mesh: shard across dp, tensor-parallel across tp.
    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_index = FSDPDistributedIndex(dp_tp, dp_shard_dim="dp", tp_dim="tp")
    dp_rank, tp_rank = divmod(rank, 2)
    assert _ranks(tp_index.tp_group) == [2 * dp_rank, 2 * dp_rank + 1]
    assert _ranks(tp_index.get_dp_group()) == _ranks(tp_index.fsdp_group) == [tp_rank, tp_rank + 2]
    assert (tp_index.tp_size, tp_index.tp_rank, tp_index.fsdp_rank) == (2, tp_rank, dp_rank)
    assert tp_index.get_submesh(("dp", "tp")) is dp_tp
    assert not tp_index.use_hybrid_fsdp and tp_index.get_outer_fsdp_group() is None

    # A flattened dim as the shard dim (Megatron-FSDP's "dp_cp").
    dp_cp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp_cp["dp", "cp"]._flatten("dp_cp")
    flat_index = FSDPDistributedIndex(dp_cp, dp_shard_dim="dp_cp")
    assert _ranks(flat_index.fsdp_group) == [0, 1, 2, 3] and flat_index.fsdp_rank == rank

    # Bad input: the same ValueError on every rank, naming what is available.
    with pytest.raises(
        ValueError,
        match=r"dp_shard_dim='dp' is not a dim of the device_mesh .*\['dp_outer', 'dp_shard', 'tp', 'dp_outer_dp_shard'\]",
    ):
        FSDPDistributedIndex(mesh, dp_shard_dim="dp")
    with pytest.raises(ValueError, match=r"tp_dim='model' is not a dim"):
        FSDPDistributedIndex(dp_tp, dp_shard_dim="dp", tp_dim="model")
    with pytest.raises(
        ValueError, match=r"dp_shard_dim is required for the 2-D device_mesh .*\['dp', 'tp'\]"
    ):
        FSDPDistributedIndex(dp_tp)
    with pytest.raises(
        ValueError,
        match=r"must name different dims; got \{'dp_shard_dim': 'dp', 'dp_outer_dim': 'dp'",
    ):
        FSDPDistributedIndex(dp_tp, dp_shard_dim="dp", dp_outer_dim="dp")
    with pytest.raises(
        ValueError, match=r"hsdp_outer_dp_shard=True .* dp_outer_dim is None.*\['dp', 'tp'\]"
    ):
        FSDPDistributedIndex(dp_tp, dp_shard_dim="dp", hsdp_outer_dp_shard=True)
    with pytest.raises(ValueError, match=r"dp_shard_dim='dp' is not a dim of the expt_device_mesh"):
        FSDPDistributedIndex(dp_tp, dp_shard_dim="dp", expt_device_mesh=expt)
    with pytest.raises(ValueError, match=r"outer dim must come before the shard dim"):
        FSDPDistributedIndex(dp_tp, dp_shard_dim="dp", dp_outer_dim="tp")
    with pytest.raises(ValueError, match=r"hsdp_outer_dp_shard=False and dp_outer_dim=None"):
        tp_index.get_logical_hybrid_fsdp_rank()
    with pytest.raises(ValueError, match=r"expert_parallel=4 must divide dp_shard=2.*\[1, 2\]"):
        build_device_mesh(dp_shard=2, dp_outer=2, expert_parallel=4, device_type="cpu")
    with pytest.raises(
        ValueError, match=r"dp_outer=1 \* dp_shard=2 \* tp=1 = 2 ranks, but the world size is 4"
    ):
        build_device_mesh(dp_shard=2, device_type="cpu")
    return rank


@pytest.mark.parametrize(
    ("world_size", "fn"), [(1, _world_1), (2, _world_2), (4, _world_4)], ids=["1", "2", "4"]
)
def test_distributed_index(world_size, fn):
    out = run_distributed(fn, world_size, timeout=120.0, device_type="cpu")
    assert out == list(range(world_size))
