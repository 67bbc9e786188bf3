"""Mesh combinations Megatron-FSDP's own tests exercise, CPU/gloo, world size 4 (8
where a dim of 2 more is needed for anything to be sharded over it).

* Tensor parallelism with hybrid sharding: a mesh (dp_outer 2, dp_shard 1, tp 2), the
  model of ``test_tensor_parallel.py`` parallelized with torch's ``parallelize_module``
  or Megatron-Core style, outer strategy ``no_shard`` (HSDP), and ``optim``
  (fully-sharded HSDP) on (2, 2, 2), trains like one process on the whole global batch
  (losses, gradient norms, final parameters; fp32, 1e-5 relative), and its state dict
  holds DTensors on fsdp's dim x tp whose local tensors are the ``torch.chunk`` pieces
  their placements say. What it cannot do is refused on every rank.
* Meta-device initialization with fully-sharded HSDP (fp32, and bf16 with fp32 main
  weights) and with tensor parallelism (``parallelize_module`` on the meta device, also
  with HSDP and fully-sharded HSDP; Megatron-Core style layers): every rank's shards are bit for bit
  those of the eagerly built model, and training matches one process.
* Expert parallelism with hybrid sharding (outer ``no_shard`` and ``optim``): losses,
  gradient norms (``model.clip_grad_norm_``) and every expert match one process.

Plain ``dcp.save``/``dcp.load`` round trips of these: ``test_plain_dcp_meshes.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn import functional as F

from fsdp_buffers import MixedPrecisionPolicy
from fsdp_hooks import DistributedDataParallelConfig, MegatronFSDP, fully_shard
from fsdp_mesh import FSDPDistributedIndex, build_device_mesh
from fsdp_mesh.testing import load_sibling, mean_over_ranks, run_distributed

WORLD = 4


tp = load_sibling(__file__, "test_tensor_parallel.py")


# ---- tensor parallelism with hybrid sharding -------------------------------------------


def wrap_tp_hybrid(kind: str, outer: str, strategy: int = 3, given_group: bool = False):
    """The tp test's model on (dp_outer 2, dp_shard world/4, tp 2) under hybrid
    sharding; ``given_group``: with the hybrid group flattened by the caller and passed
    as ``hybrid_fsdp_group``, as Megatron-FSDP's own tests do."""
    mesh = build_device_mesh(dp_outer=2, dp_shard=dist.get_world_size() // 4, tp=2).device_mesh
    net = tp._net(kind, mesh)
    group = {}
    if given_group:
        group["hybrid_fsdp_group"] = mesh["dp_outer", "dp_shard"]._flatten("hsdp").get_group()
    return fully_shard(
        net,
        tp._optimizer(net.parameters()),
        device_mesh=mesh,
        dp_shard_dim="dp_shard",
        dp_outer_dim="dp_outer",
        tp_dim="tp",
        fsdp_unit_modules=[tp.Block],
        zero_dp_strategy=strategy,
        outer_dp_sharding_strategy=outer,
        **group,
    )


def train_tp(model, opt, start, stop):
    """Steps ``start..stop`` on the tp test's batches: data-parallel rank r (both of
    its tp ranks) takes its 1/dp of the global batch. Returns (losses, norms)."""
    idx = model.dist_index
    per = tp.DP * tp.ROWS // idx.dp_size
    rows = slice(idx.dp_rank * per, (idx.dp_rank + 1) * per)
    losses, norms = [], []
    for step in range(start, stop):
        x, y = tp._batch(step)
        loss = F.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        norms.append(
            tp._norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), tp.MAX_NORM))
        )
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses, norms


def _chunk_check(model) -> list[str]:
    """Names whose DTensor's local tensor is not the piece its placements say:
    ``full_tensor()`` redistributed back must give the same local tensor."""
    bad = []
    for name, value in model.state_dict().items():
        assert isinstance(value, DTensor), name
        full = value.full_tensor()
        again = torch.distributed.tensor.distribute_tensor(
            full, value.device_mesh, value.placements, src_data_rank=None
        )
        if not torch.equal(again.to_local(), value.to_local()):
            bad.append(name)
    return bad


def _tp_hybrid_job(kind, outer, strategy, ckpt_dir, given_group=False):
    from fsdp_ckpt import load_checkpoint, save_checkpoint

    model, opt = wrap_tp_hybrid(kind, outer, strategy, given_group)
    losses, norms = train_tp(model, opt, 0, tp.STEPS)
    out = {
        "losses": losses,
        "norms": norms,
        "params": model.buffer.views.full_parameters(),
        "meshes": {
            n: (v.device_mesh.mesh_dim_names, tuple(v.placements))
            for n, v in model.state_dict().items()
        },
        "bad_chunks": _chunk_check(model),
    }
    # fsdp's checkpoint: saved here, loaded into a fresh wrap of another seed.
    save_checkpoint(ckpt_dir, model, opt, extra={"step": tp.STEPS})
    model, opt = wrap_tp_hybrid(kind, outer, strategy, given_group)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    assert load_checkpoint(ckpt_dir, model, opt) == {"step": tp.STEPS}
    out["resumed"] = train_tp(model, opt, tp.STEPS, tp.STEPS + tp.MORE)[0]
    return out


def _assert_parity(results):
    ref_losses, ref_norms, ref_params = tp._reference()
    assert max(ref_norms[: tp.STEPS]) > tp.MAX_NORM  # clipping is exercised
    for rank, out in enumerate(results):
        torch.testing.assert_close(out["losses"], ref_losses[: tp.STEPS], rtol=1e-5, atol=0)
        torch.testing.assert_close(out["norms"], ref_norms[: tp.STEPS], rtol=1e-5, atol=0)
        assert set(out["params"]) == set(ref_params), rank
        for name, ref in ref_params.items():
            tp._close(out["params"][name], ref, f"rank {rank} {name}")
        assert out["bad_chunks"] == [], (rank, out["bad_chunks"])
        if "resumed" in out:
            torch.testing.assert_close(out["resumed"], ref_losses[tp.STEPS :], rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "kind, outer, strategy, world, given_group",
    [
        ("dtensor", "no_shard", 3, WORLD, False),
        ("megatron", "no_shard", 1, WORLD, False),
        # Fully sharded: over the outer dim alone (2 x 1 x 2), and over both (2 x 2 x 2).
        ("dtensor", "optim", 3, WORLD, False),
        ("dtensor", "optim", 3, 8, False),
        # The hybrid group flattened by the caller and passed in (Megatron-FSDP's tests).
        ("megatron", "optim", 3, WORLD, True),
    ],
)
def test_tp_with_hybrid_sharding_matches_one_process(
    tmp_path, kind, outer, strategy, world, given_group
):
    """Parity with one process (see the module note); then a checkpoint of fsdp's own
    (``save_checkpoint``), loaded into a fresh wrap, resumes with its losses."""
    ckpt = str(tmp_path / "ckpt")
    results = run_distributed(
        _tp_hybrid_job, world, args=(kind, outer, strategy, ckpt, given_group), timeout=240
    )
    _assert_parity(results)
    meshes = results[0]["meshes"]
    # fsdp's dim x tp: the shard dim (outer replicate) or the flattened hybrid dim.
    fsdp_dim = "dp_shard"
    if outer == "optim":
        fsdp_dim = "hsdp" if given_group else "dp_outer_dp_shard"
    assert meshes["blocks.0.up.weight"][0] == (fsdp_dim, "tp"), meshes
    assert meshes["inp.weight"][0] == (fsdp_dim, "tp"), meshes


def _tp_hybrid_bad_inputs():
    """What tensor parallelism with hybrid sharding cannot do: the same error on every
    rank, before anything is sharded."""
    mesh = build_device_mesh(dp_outer=2, dp_shard=1, tp=2).device_mesh
    # The hybrid groups' ranks, as groups of their own: no dim of the mesh.
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    plain = pairs[dist.get_rank() % 2]
    out = {}

    def given_group_fully_sharded():
        # A hybrid group that is no mesh dim leaves no mesh for the views' (hybrid, tp).
        index = FSDPDistributedIndex(
            mesh, "dp_shard", "dp_outer", "tp", hybrid_fsdp_group=plain, hsdp_outer_dp_shard=True
        )
        MegatronFSDP(
            tp._net("dtensor", mesh),
            index,
            DistributedDataParallelConfig(
                data_parallel_sharding_strategy="optim_grads_params",
                outer_dp_sharding_strategy="optim",
            ),
            fsdp_unit_modules=[tp.Block],
        )

    def outer_after_tp():
        odd = torch.distributed.device_mesh.init_device_mesh(
            "cpu", (1, 2, 2), mesh_dim_names=("dp_shard", "tp", "dp_outer")
        )
        group = odd["dp_outer"].get_group()  # with dp_shard of 1, the hybrid group
        index = FSDPDistributedIndex(odd, "dp_shard", "dp_outer", "tp", hybrid_fsdp_group=group)
        MegatronFSDP(tp._net("dtensor", odd), index, fsdp_unit_modules=[tp.Block])

    for name, fn in (("given_group", given_group_fully_sharded), ("order", outer_after_tp)):
        try:
            fn()
            out[name] = None
        except (ValueError, NotImplementedError) as err:
            out[name] = (type(err).__name__, str(err))
    return out


def test_tp_with_hybrid_sharding_bad_input():
    for rank, out in enumerate(run_distributed(_tp_hybrid_bad_inputs, WORLD, timeout=120)):
        assert out["given_group"] is not None and out["given_group"][0] == "NotImplementedError"
        assert "no flattened dim of its root mesh" in out["given_group"][1], (rank, out)
        assert out["order"] is not None and out["order"][0] == "ValueError", (rank, out)
        assert "comes before dp_outer_dim='dp_outer'" in out["order"][1], (rank, out)


# ---- meta-device initialization with fully-sharded HSDP ----------------------------------

hybrid = load_sibling(__file__, "test_hybrid.py")


def _hybrid_gpt(meta: bool, dtype: torch.dtype):
    """``test_hybrid``'s model: GPT plus a real 0-d parameter (kept as it is), built in
    ``dtype`` (the random numbers are drawn in it, as meta initialization draws them)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta" if meta else "cpu"):
            module = hybrid.GPT(hybrid.CFG)
        module.scale = torch.nn.Parameter(torch.tensor(1.0))
    finally:
        torch.set_default_dtype(previous)
    return module


def wrap_hybrid(meta: bool, outer: str = "optim", dtype: torch.dtype = torch.float32):
    """``test_hybrid``'s model on (dp_outer 2, dp_shard 2), built on the meta device and
    materialized by fsdp, or built eagerly; the same seed either way."""
    torch.manual_seed(0)
    module = _hybrid_gpt(meta, dtype)
    extra = {"mixed_precision_policy": MixedPrecisionPolicy()} if dtype != torch.float32 else {}
    return fully_shard(
        module,
        hybrid._optimizer(module.parameters()),
        device_mesh=build_device_mesh(dp_outer=2, dp_shard=2).device_mesh,
        dp_shard_dim="dp_shard",
        dp_outer_dim="dp_outer",
        fsdp_unit_modules=[hybrid.Block],
        outer_dp_sharding_strategy=outer,
        init_model_with_meta_device=meta,
        **extra,
    )


def train_hybrid(model, opt, start, stop):
    """Rank r trains on its quarter of ``test_hybrid``'s global batch; mean losses."""
    rank, per = dist.get_rank(), hybrid.K * hybrid.M
    losses = []
    for step in range(start, stop):
        x, y = hybrid._global_batch(step)
        xb, yb = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        loss = F.cross_entropy(model(xb).flatten(0, 1), yb.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), hybrid.MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss.detach()))
    return losses


def _local_state(model) -> dict[str, torch.Tensor]:
    """This rank's compute-weight shards and main-weight pieces, bucket by bucket."""
    out = {}
    for b in model.buffer.buckets:
        out[f"model.{b.gid}"] = b.model.data.clone()
        out[f"main.{b.gid}"] = b.main_weights.data.clone()
    return out


def _meta_fully_sharded_job(dtype):
    eager, _ = wrap_hybrid(meta=False, dtype=dtype)
    model, opt = wrap_hybrid(meta=True, dtype=dtype)
    assert sum(b.outer_sharded for b in model.buffer.buckets) > 0
    want, got = _local_state(eager), _local_state(model)
    differ = [k for k in want if want[k].dtype != got[k].dtype or not torch.equal(want[k], got[k])]
    losses = train_hybrid(model, opt, 0, hybrid.STEPS) if dtype == torch.float32 else None
    return {"differ": differ, "losses": losses}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_init_with_fully_sharded_hsdp(dtype):
    """Every compute shard and main-weight piece is bit-for-bit what wrapping the
    eagerly built model gives (bf16: fp32 main weights, a buffer of their own), and
    fp32 training then matches one process."""
    results = run_distributed(_meta_fully_sharded_job, WORLD, args=(dtype,), timeout=180)
    for rank, out in enumerate(results):
        assert out["differ"] == [], (rank, out["differ"])
    if dtype == torch.float32:
        ref_losses, _norms, _params = hybrid._reference()
        torch.testing.assert_close(results[0]["losses"], ref_losses, rtol=1e-5, atol=0)


# ---- meta-device initialization with tensor parallelism -------------------------------------


def _outer_only_job():
    """Fully-sharded HSDP with a shard dim of one: (dp_outer 2, dp_shard 1)."""
    torch.manual_seed(0)
    module = hybrid._gpt()
    model, opt = fully_shard(
        module,
        hybrid._optimizer(module.parameters()),
        device_mesh=build_device_mesh(dp_outer=2, dp_shard=1).device_mesh,
        dp_shard_dim="dp_shard",
        dp_outer_dim="dp_outer",
        fsdp_unit_modules=[hybrid.Block],
        outer_dp_sharding_strategy="optim",
    )
    trainable = [b for b in model.buffer.buckets if b.group.requires_grad]
    params = [p for g in opt.param_groups for p in g["params"]]
    rank, per = dist.get_rank(), hybrid.WORLD // 2 * hybrid.K * hybrid.M
    losses = []
    for step in range(hybrid.STEPS):
        x, y = hybrid._global_batch(step)
        xb, yb = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        loss = F.cross_entropy(model(xb).flatten(0, 1), yb.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), hybrid.MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss.detach()))
    state = [v for p in params for v in opt.state[p].values() if isinstance(v, DTensor)]
    return {
        "not_outer_sharded": [
            b.group.names for b in trainable if not b.outer_sharded and not b.group.fsdp_no_shard
        ],
        # Each rank holds half of the rows of every matrix: main weights and Adam state.
        "whole": [
            tuple(p.shape)
            for p in params + state
            if p.dim() == 2 and p.to_local().shape[0] != -(-p.shape[0] // 2)
        ],
        "losses": losses,
        "params": model.buffer.views.full_parameters(),
    }


def test_fully_sharded_hsdp_with_a_shard_dim_of_one_shards_over_the_outer_dim():
    """Megatron-FSDP's outer ``optim`` shards main weights and optimizer state over the
    outer dim whatever the shard dim's size; with ``dp_shard`` 1 fsdp shards them over
    ``dp_outer`` (it kept them whole before), and training matches one process."""
    ref_losses, _norms, ref_params = hybrid._reference()
    for out in run_distributed(_outer_only_job, 2, timeout=120):
        assert out["not_outer_sharded"] == [] and out["whole"] == [], out
        torch.testing.assert_close(out["losses"], ref_losses, rtol=1e-5, atol=0)
        for name, ref in ref_params.items():
            torch.testing.assert_close(out["params"][name], ref, rtol=1e-5, atol=1e-6)


def wrap_tp_meta(meta: bool, outer: str | None):
    """The tp test's model parallelized with ``parallelize_module``, built on the meta
    device (and materialized by fsdp) or eagerly, on (dp_shard 2, tp 2) or, with an
    ``outer`` strategy, (dp_outer 2, dp_shard world/4, tp 2)."""
    hybrid_dims = {"dp_outer_dim": "dp_outer", "outer_dp_sharding_strategy": outer}
    if outer in (None, "megatron"):
        mesh = build_device_mesh(dp_shard=2, tp=2).device_mesh
        hybrid_dims = {}
    else:
        dp_shard = dist.get_world_size() // 4
        mesh = build_device_mesh(dp_outer=2, dp_shard=dp_shard, tp=2).device_mesh
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        net = tp.Net()
    plan = {}
    for i in range(len(net.blocks)):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    parallelize_module(net, mesh["tp"], plan)
    torch.manual_seed(0)
    return fully_shard(
        net,
        tp._optimizer(net.parameters()),
        device_mesh=mesh,
        dp_shard_dim="dp_shard",
        tp_dim="tp",
        fsdp_unit_modules=[tp.Block],
        init_model_with_meta_device=meta,
        **hybrid_dims,
    )


class _WholeInit:
    """Megatron-Core's CPU initialization, in ``reset_parameters``: draw the whole
    ``nn.Linear`` (weight, then bias), keep this tp rank's piece."""

    def reset_parameters(self):
        n, k = dist.get_world_size(self.group), dist.get_rank(self.group)
        whole = torch.nn.Linear(*self.features)
        self.weight.copy_(whole.weight.chunk(n, self.weight.partition_dim)[k])
        bias_dim = getattr(self.bias, "partition_dim", None)
        self.bias.copy_(whole.bias if bias_dim is None else whole.bias.chunk(n, 0)[k])


class MetaColumn(_WholeInit, tp.ColumnParallelLinear):
    def __init__(self, fin, fout, group):
        torch.nn.Module.__init__(self)
        n = dist.get_world_size(group)
        self.group, self.features = group, (fin, fout)
        self.weight = tp._mark(torch.nn.Parameter(torch.empty(fout // n, fin)), 0)
        self.bias = tp._mark(torch.nn.Parameter(torch.empty(fout // n)), 0)


class MetaRow(_WholeInit, tp.RowParallelLinear):
    def __init__(self, fin, fout, group):
        torch.nn.Module.__init__(self)
        n = dist.get_world_size(group)
        self.group, self.features = group, (fin, fout)
        self.weight = tp._mark(torch.nn.Parameter(torch.empty(fout, fin // n)), 1)
        self.bias = torch.nn.Parameter(torch.empty(fout))
        self.bias.tensor_model_parallel = False


def wrap_megatron_meta():
    """The tp test's model with Megatron-Core style tp layers built on the meta device
    in place of its linears (in the same order, so the same random draws)."""
    mesh = build_device_mesh(dp_shard=2, tp=2).device_mesh
    group = mesh["tp"].get_group()
    with torch.device("meta"):
        net = tp.Net()
        for block in net.blocks:
            block.up = MetaColumn(tp.DIM, tp.HIDDEN, group)
            block.down = MetaRow(tp.HIDDEN, tp.DIM, group)
    torch.manual_seed(0)
    return fully_shard(
        net,
        tp._optimizer(net.parameters()),
        device_mesh=mesh,
        dp_shard_dim="dp_shard",
        tp_dim="tp",
        fsdp_unit_modules=[tp.Block],
        init_model_with_meta_device=True,
    )


def _tp_meta_job(outer):
    eager, _ = wrap_tp_meta(meta=False, outer=outer)
    if outer == "megatron":
        model, opt = wrap_megatron_meta()
    else:
        model, opt = wrap_tp_meta(meta=True, outer=outer)
    want, got = _local_state(eager), _local_state(model)
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    kinds = {n: model.buffer.tp.spec(p).kind.name for n, _g, _i, p in model.buffer.named_params()}
    losses, norms = train_tp(model, opt, 0, tp.STEPS)
    return {"differ": differ, "kinds": kinds, "losses": losses, "norms": norms}


@pytest.mark.parametrize(
    "outer, world", [(None, WORLD), ("no_shard", WORLD), ("megatron", WORLD), ("optim", 8)]
)
def test_meta_init_with_tensor_parallelism(outer, world):
    """A model built on the meta device and parallelized there (``parallelize_module``;
    "megatron": Megatron-Core style layers whose ``reset_parameters`` keeps its piece of
    a whole draw): each rank's tp piece is the piece of the eagerly built model's
    tensor (bit for bit), and training then matches one process."""
    results = run_distributed(_tp_meta_job, world, args=(outer,), timeout=240)
    ref_losses, ref_norms, _params = tp._reference()
    kind = "MCORE" if outer == "megatron" else "DTENSOR"
    for rank, out in enumerate(results):
        assert out["differ"] == [], (rank, out["differ"])
        assert out["kinds"]["blocks.0.up.weight"] == kind
        torch.testing.assert_close(out["losses"], ref_losses[: tp.STEPS], rtol=1e-5, atol=0)
        torch.testing.assert_close(out["norms"], ref_norms[: tp.STEPS], rtol=1e-5, atol=0)


# ---- expert parallelism with hybrid sharding ------------------------------------------------

toy = load_sibling(__file__, "test_expert.py")


def wrap_expert_hybrid(outer: str, strategy: int = 3):
    """``test_expert``'s MoE with its experts split over 2 expert-parallel ranks, on
    (dp_outer 2, dp_shard world/2) and the expert mesh (dp_outer 2, dp_shard world/4,
    ep 2). Returns (model, optimizer, this rank's expert ids)."""
    world = dist.get_world_size()
    meshes = build_device_mesh(dp_outer=2, dp_shard=world // 2, expert_parallel=toy.EP)
    ep_mesh = meshes.expt_device_mesh["ep"]
    torch.manual_seed(0)
    net = toy.Net()
    local = toy.N_EXPERTS // toy.EP
    ids = list(range(ep_mesh.get_local_rank() * local, (ep_mesh.get_local_rank() + 1) * local))
    net.moe.experts = torch.nn.ModuleList(net.moe.experts[i] for i in ids)
    net.moe.expert_ids = ids
    net.moe.group = ep_mesh.get_group()
    model, opt = fully_shard(
        net,
        torch.optim.SGD(net.parameters(), lr=toy.LR, momentum=0.9),
        **meshes.fsdp_kwargs(),
        fsdp_unit_modules=[toy.MoE],
        zero_dp_strategy=strategy,
        outer_dp_sharding_strategy=outer,
    )
    return model, opt, ids


def train_expert(model, opt, start, stop):
    """Rank r trains on its 1/world of ``test_expert``'s batch; (mean losses, norms)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per = toy.WORLD * toy.TOKENS // world
    losses, norms = [], []
    for step in range(start, stop):
        x, y = toy._batch(step)
        loss = F.mse_loss(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per])
        loss.backward()
        norms.append(model.clip_grad_norm_(float("inf"), norm_type=float("inf")).item())
        norms.append(model.clip_grad_norm_(toy.MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss.detach()))
    return losses, norms


def _expert_hybrid_job(outer, strategy):
    model, opt, ids = wrap_expert_hybrid(outer, strategy)
    buf = model.buffer
    experts = [b for b in buf.buckets if b.group.is_expert_param]
    assert experts and all(b.outer is not None for b in experts)
    losses, norms = train_expert(model, opt, 0, toy.STEPS)
    params = {toy._global_name(n, ids): t for n, t in buf.views.full_parameters().items()}
    return {
        "losses": losses,
        "norms": norms,
        "params": params,
        "outer_sharded_experts": sum(b.outer_sharded for b in experts),
        "bad_chunks": _chunk_check(model),
    }


@pytest.mark.parametrize(
    "outer, strategy, world",
    [("no_shard", 3, WORLD), ("no_shard", 1, WORLD), ("optim", 3, WORLD), ("optim", 3, 8)],
)
def test_expert_parallel_with_hybrid_sharding_matches_one_process(outer, strategy, world):
    """Experts on (dp_outer 2, dp_shard world/4, ep 2): the outer reduction runs over
    the expert mesh's outer dim; fully sharded, the experts' main weights are sharded
    over its hybrid dim too (at world 4 over the outer dim alone: expert dp_shard 1). Losses, norms (inf and 2, with clipping) and
    every expert match one process holding all of them."""
    ref_losses, ref_norms, ref_params = toy._reference(clip=True)
    results = run_distributed(_expert_hybrid_job, world, args=(outer, strategy), timeout=240)
    merged = {}
    for rank, out in enumerate(results):
        torch.testing.assert_close(out["losses"], ref_losses, rtol=1e-5, atol=0)
        torch.testing.assert_close(out["norms"], ref_norms, rtol=1e-5, atol=0)
        assert out["bad_chunks"] == [], (rank, out["bad_chunks"])
        if "resumed" in out:
            torch.testing.assert_close(out["resumed"], ref_losses[tp.STEPS :], rtol=1e-5, atol=0)
        merged.update(out["params"])
    assert set(merged) == set(ref_params)
    for name, ref in ref_params.items():
        torch.testing.assert_close(merged[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    # Fully sharded, experts' main weights are split over the expert hybrid dim, also
    # at world 4, where the expert shard dim has size 1 (over the outer dim alone).
    assert (results[0]["outer_sharded_experts"] > 0) == (outer == "optim")


# ---- tensor parallelism with an expert mesh: refused ---------------------------------------


def _tp_with_expert_mesh():
    meshes = build_device_mesh(dp_shard=2, tp=2, expert_parallel=2)
    net = tp._net("dtensor", meshes.device_mesh)

    def local(p):
        return p.to_local() if isinstance(p, DTensor) else p.detach()

    before = {n: (type(p), local(p).clone()) for n, p in net.named_parameters()}
    try:
        fully_shard(
            net,
            tp._optimizer(net.parameters()),
            device_mesh=meshes.device_mesh,
            dp_shard_dim="dp_shard",
            tp_dim="tp",
            expt_device_mesh=meshes.expt_device_mesh,
            fsdp_unit_modules=[tp.Block],
        )
    except NotImplementedError as err:
        message = str(err)
    else:
        message = None
    untouched = all(
        type(p) is before[n][0] and torch.equal(local(p), before[n][1])
        for n, p in net.named_parameters()
    )
    return {"message": message, "untouched": untouched}


def test_tp_with_an_expert_mesh_is_refused():
    """Megatron-FSDP shards experts over its expert mesh with an expert tp dim; fsdp does
    not combine expert meshes with tensor-parallel pieces yet, and says so on every rank
    before the module is touched, naming what works instead."""
    for out in run_distributed(_tp_with_expert_mesh, WORLD, timeout=120):
        assert out["message"] is not None, "tp with an expert mesh must be refused"
        assert "expt_device_mesh" in out["message"], out
        assert "tensor parallelism without expt_device_mesh" in out["message"], out
        assert out["untouched"]
