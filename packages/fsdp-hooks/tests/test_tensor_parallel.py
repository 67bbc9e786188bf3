"""Tensor parallelism under fsdp on a 2 x 2 mesh (dp_shard, tp), CPU/gloo, world size 4.

* Parity: a model parallelized with torch's ``parallelize_module`` (ColwiseParallel /
  RowwiseParallel DTensor parameters; plain layer norms and outer linears, replicated
  over tp) and the same model built Megatron-Core style (plain tp-local parameters
  marked ``tensor_model_parallel``/``partition_dim``, explicit autograd functions over
  the tp group) train, under several strategies with AdamW and ``clip_grad_norm_``,
  like one process on the whole global batch (each tp pair sees one dp rank's rows):
  the same losses, gradient norms and final parameters (fp32, 1e-5 relative).
* State dicts: DTensors on the (dp_shard, tp) mesh with both placements.
* Checkpoints: a DCP checkpoint saved under tp x fsdp consolidates, in one process, to
  the run's full parameters exactly; it loads back into the DTensor model and into the
  Megatron-style one (another strategy), which continue with the losses of one
  uninterrupted run.
* Bad input: a clear error on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn import functional as F

from fsdp_hooks import FullyShardedDataParallel, fully_shard, fully_shard_optimizer
from fsdp_mesh import FSDPDistributedIndex, build_device_mesh
from fsdp_mesh.testing import run_distributed

WORLD, DP, TP = 4, 2, 2
DIN, DIM, HIDDEN, DOUT = 6, 10, 12, 5
ROWS = 4  # per dp rank per step
STEPS, MORE = 3, 2  # trained before the checkpoint, and after loading it
LR = 1e-2
MAX_NORM = 0.5
# (model, strategy); "adapter": the Megatron-style model through FullyShardedDataParallel.
RUNS = (("dtensor", 3), ("dtensor", 1), ("megatron", 3), ("megatron", 0), ("adapter", 3))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)  # column-parallel
        self.down = nn.Linear(HIDDEN, DIM)  # row-parallel

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIN, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, DOUT)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(DP * ROWS, DIN, generator=g), torch.randn(DP * ROWS, DOUT, generator=g)


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def _norm_value(norm):
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()


def _reference():
    """Losses and norms of STEPS + MORE steps, and the parameters after STEPS."""
    torch.manual_seed(0)
    net = Net()
    opt = _optimizer(net.parameters())
    losses, norms, params = [], [], None
    for step in range(STEPS + MORE):
        x, y = _batch(step)
        loss = F.mse_loss(net(x), y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == STEPS - 1:
            params = {n: p.detach().clone() for n, p in net.named_parameters()}
    return losses, norms, params


# ---- Megatron-Core style tensor parallelism ----------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient over tp (a column-parallel input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward over tp, identity backward (a row-parallel output)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _mark(p, dim):
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
    return p


class ColumnParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, group):
        super().__init__()
        n, k = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        self.weight = _mark(nn.Parameter(full.weight.detach().chunk(n, 0)[k].clone()), 0)
        self.bias = _mark(nn.Parameter(full.bias.detach().chunk(n, 0)[k].clone()), 0)

    def forward(self, x):
        return F.linear(_CopyToTP.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, group):
        super().__init__()
        n, k = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        self.weight = _mark(nn.Parameter(full.weight.detach().chunk(n, 1)[k].clone()), 1)
        self.bias = nn.Parameter(full.bias.detach().clone())
        self.bias.tensor_model_parallel = False  # explicitly duplicated over tp

    def forward(self, x):
        return _ReduceFromTP.apply(F.linear(x, self.weight), self.group) + self.bias


# ---- ranks ---------------------------------------------------------------------------


def _mesh():
    return build_device_mesh(dp_shard=DP, tp=TP).device_mesh


def _net(kind, mesh, seed=0):
    torch.manual_seed(seed)
    net = Net()
    if kind == "dtensor":
        plan = {}
        for i in range(len(net.blocks)):
            plan[f"blocks.{i}.up"] = ColwiseParallel()
            plan[f"blocks.{i}.down"] = RowwiseParallel()
        parallelize_module(net, mesh["tp"], plan)
    else:
        group = mesh["tp"].get_group()
        for block in net.blocks:
            block.up = ColumnParallelLinear(block.up, group)
            block.down = RowParallelLinear(block.down, group)
    return net


def _wrap(kind, strategy, seed=0):
    mesh = _mesh()
    if kind == "adapter":
        index = FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard", tp_dim="tp")
        model = FullyShardedDataParallel(
            None,
            {"data_parallel_sharding_strategy": strategy},
            _net("megatron", mesh, seed),
            fsdp_unit_modules=[Block],
            dist_index=index,
        )
        return model, fully_shard_optimizer(_optimizer(model.parameters()))
    net = _net(kind, mesh, seed)
    return fully_shard(
        net,
        _optimizer(net.parameters()),
        device_mesh=mesh,
        dp_shard_dim="dp_shard",
        tp_dim="tp",
        fsdp_unit_modules=[Block],
        zero_dp_strategy=strategy,
    )


def _train(model, opt, start, stop):
    dp_rank = model.dist_index.fsdp_rank
    losses, norms = [], []
    for step in range(start, stop):
        x, y = _batch(step)
        rows = slice(dp_rank * ROWS, (dp_rank + 1) * ROWS)  # both tp ranks: the same rows
        loss = F.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        if isinstance(model, FullyShardedDataParallel):
            # Automatic sync is off there: as in Megatron-FSDP, .grad is empty until the
            # sync, so clip after it (Megatron-Core's loop calls finalize_model_grads first).
            model.finish_grad_sync()
        norms.append(_norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / WORLD)
    return losses, norms


def _describe_state_dict(model):
    out = {}
    for name, value in model.state_dict().items():
        assert isinstance(value, DTensor), name
        out[name] = (tuple(value.placements), tuple(value.shape), value.device_mesh.mesh_dim_names)
    return out


def _buffer(model):
    return model.module.buffer if isinstance(model, FullyShardedDataParallel) else model.buffer


def _full_params(model):
    return _buffer(model).views.full_parameters()


def _run(kind, strategy, ckpt_dir):
    from fsdp_ckpt import get_full_model_state_dict, save_checkpoint

    model, opt = _wrap(kind, strategy)
    specs = _buffer(model).tp.specs
    assert specs is not None
    kinds = {n: specs[p].kind.name for n, _g, _i, p in _buffer(model).named_params()}
    losses, norms = _train(model, opt, 0, STEPS)
    out = {
        "losses": losses,
        "norms": norms,
        "params": _full_params(model),
        "state_dict": _describe_state_dict(model),
        "kinds": kinds,
    }
    if ckpt_dir is not None:
        save_checkpoint(ckpt_dir, model, opt, extra={"step": STEPS})
        out["gathered"] = get_full_model_state_dict(model)
    if kind == "adapter":  # tp ranks get tp rank 0's default RNG state, dp ranks keep theirs
        torch.manual_seed(dist.get_rank())
        model.sync_rng_states_across_tp_group()
        out["rand"] = [None] * WORLD
        dist.all_gather_object(out["rand"], torch.rand(3))
    return out


def _resume(kind, strategy, ckpt_dir):
    from fsdp_ckpt import load_checkpoint

    model, opt = _wrap(kind, strategy, seed=1234)
    assert load_checkpoint(ckpt_dir, model, opt) == {"step": STEPS}
    return _train(model, opt, STEPS, STEPS + MORE)[0]


def _job(ckpt_dir):
    rank = dist.get_rank()
    out = {"runs": {}}
    for kind, strategy in RUNS:
        save = ckpt_dir if (kind, strategy) == RUNS[0] else None
        result = _run(kind, strategy, save)
        out["runs"][(kind, strategy)] = result if rank == 0 else result["state_dict"]
    out["resumed"] = {
        ("dtensor", 3): _resume("dtensor", 3, ckpt_dir),
        ("megatron", 2): _resume("megatron", 2, ckpt_dir),
    }
    out["bad"] = _bad_inputs()
    out["classified"] = _classifications_per_wrap()
    return out


def _classifications_per_wrap():
    """Before: the wrapper's replica check and the buffer each classified the
    parameters (``tensor_parallel_specs``); one wrap classifies them once."""
    from unittest import mock

    from fsdp_buffers import tensor_parallel

    spy = mock.patch.object(
        tensor_parallel, "tensor_parallel_specs", wraps=tensor_parallel.tensor_parallel_specs
    )
    with spy as calls:
        _wrap("dtensor", 3)
    return calls.call_count


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    ckpt_dir = str(tmp_path_factory.mktemp("tp_ckpt") / "ckpt")
    return ckpt_dir, run_distributed(_job, WORLD, args=(ckpt_dir,), timeout=180)


# ---- tests ---------------------------------------------------------------------------


def _close(got, ref, msg):
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{msg}: {m}")


def test_parity_with_one_process(world4):
    ref_losses, ref_norms, ref_params = _reference()
    assert max(ref_norms[:STEPS]) > MAX_NORM  # clipping is exercised
    runs = world4[1][0]["runs"]
    for run in RUNS:
        result = runs[run]
        torch.testing.assert_close(result["losses"], ref_losses[:STEPS], rtol=1e-5, atol=0)
        torch.testing.assert_close(result["norms"], ref_norms[:STEPS], rtol=1e-5, atol=0)
        assert set(result["params"]) == set(ref_params), run
        for name, ref in ref_params.items():
            _close(result["params"][name], ref, f"{run} {name}")
    kinds = runs[("dtensor", 3)]["kinds"]
    assert kinds["blocks.0.up.weight"] == kinds["blocks.1.down.bias"] == "DTENSOR"
    assert kinds["blocks.0.norm.weight"] == kinds["inp.weight"] == "REPLICATED"
    kinds = runs[("megatron", 3)]["kinds"]
    assert kinds["blocks.0.up.weight"] == kinds["blocks.0.down.weight"] == "MCORE"
    assert kinds["blocks.0.down.bias"] == kinds["head.bias"] == "REPLICATED"
    rand = runs[("adapter", 3)]["rand"]  # ranks 2k, 2k+1 form a tp pair
    assert torch.equal(rand[0], rand[1]) and torch.equal(rand[2], rand[3])
    assert not torch.equal(rand[0], rand[2])


def test_state_dict_placements(world4):
    strided = _StridedShard(0, split_factor=TP)
    expected = {
        # (fsdp placement, tp placement) on the (dp_shard, tp) mesh, global shapes.
        "blocks.0.up.weight": ((strided, Shard(0)), (HIDDEN, DIM)),
        "blocks.0.up.bias": ((strided, Shard(0)), (HIDDEN,)),
        "blocks.0.down.weight": ((Shard(0), Shard(1)), (DIM, HIDDEN)),
        "blocks.0.down.bias": ((Shard(0), Replicate()), (DIM,)),
        "blocks.0.norm.weight": ((Shard(0), Replicate()), (DIM,)),
        "inp.weight": ((Shard(0), Replicate()), (DIM, DIN)),
    }
    no_shard = {k: ((Replicate(), pl[1]), shape) for k, (pl, shape) in expected.items()}
    results = world4[1]
    for rank, out in enumerate(results):
        for run, want in (
            (("dtensor", 3), expected),
            (("megatron", 3), expected),
            (("megatron", 0), no_shard),
        ):
            runs = out["runs"][run]
            described = runs["state_dict"] if rank == 0 else runs
            for name, (placements, shape) in want.items():
                got = described[name]
                assert got == (placements, shape, ("dp_shard", "tp")), (rank, run, name, got)


def test_checkpoint_consolidates_and_resumes(world4, tmp_path):
    from fsdp_ckpt import consolidate_checkpoint, load_full_state_dict

    ckpt_dir, results = world4
    run = results[0]["runs"][RUNS[0]]
    out = tmp_path / "full.pt"
    consolidate_checkpoint(ckpt_dir, out)
    full = load_full_state_dict(out)
    assert set(full) == set(run["params"])
    for name, value in full.items():
        assert torch.equal(value, run["params"][name]), name
        assert torch.equal(run["gathered"][name], run["params"][name]), name
    ref_losses, _norms, _params = _reference()
    for resumed, losses in results[0]["resumed"].items():
        torch.testing.assert_close(
            losses, ref_losses[STEPS:], rtol=1e-5, atol=0, msg=lambda m, r=resumed: f"{r}: {m}"
        )


# ---- bad input -----------------------------------------------------------------------


def _error_of(fn):
    try:
        fn()
    except (ValueError, NotImplementedError) as err:
        return type(err).__name__, str(err)
    return None


def _bad_inputs():
    mesh = _mesh()
    out = {}

    def wrap(net, **kwargs):
        kwargs = {"device_mesh": mesh, "dp_shard_dim": "dp_shard", "tp_dim": "tp", **kwargs}
        fully_shard(net, _optimizer(net.parameters()), **kwargs)

    def on_mesh(sub, placements):
        torch.manual_seed(0)
        net = Net()
        w = net.blocks[0].up.weight
        net.blocks[0].up.weight = nn.Parameter(distribute_tensor(w.detach(), sub, placements))
        return net

    out["wrong_mesh"] = _error_of(lambda: wrap(on_mesh(mesh["dp_shard"], [Shard(0)])))
    out["no_tp_dim"] = _error_of(lambda: wrap(_net("dtensor", mesh), tp_dim=None))

    def partial():
        net = on_mesh(mesh["tp"], [Replicate()])
        w = net.blocks[0].up.weight
        local = w.to_local().detach() / TP
        net.blocks[0].up.weight = nn.Parameter(
            DTensor.from_local(local, mesh["tp"], [Partial()], run_check=False)
        )
        wrap(net)

    out["partial"] = _error_of(partial)

    def no_partition_dim():
        torch.manual_seed(0)
        net = Net()
        net.head.weight.tensor_model_parallel = True
        wrap(net)

    out["no_partition_dim"] = _error_of(no_partition_dim)

    def sequence_parallel():
        torch.manual_seed(0)
        net = Net()
        net.blocks[0].norm.weight.sequence_parallel = True
        wrap(net)

    out["sequence_parallel"] = _error_of(sequence_parallel)

    def differing_replicas():
        net = _net("dtensor", mesh)
        with torch.no_grad():
            net.blocks[1].norm.bias.add_(float(mesh["tp"].get_local_rank()))
        wrap(net)

    out["differing_replicas"] = _error_of(differing_replicas)
    return out


def test_parameters_are_classified_once_per_wrap(world4):
    assert [r["classified"] for r in world4[1]] == [1] * WORLD


def test_bad_input_errors_on_every_rank(world4):
    expected = {
        "wrong_mesh": ("ValueError", "but fsdp's tensor-parallel mesh is"),
        "no_tp_dim": ("ValueError", "no tp_dim was given"),
        "partial": ("ValueError", "placement Partial"),
        "no_partition_dim": ("ValueError", "no 'partition_dim'"),
        "sequence_parallel": ("NotImplementedError", "sequence_parallel=True"),
        "differing_replicas": ("ValueError", "['blocks.1.norm.bias']"),
    }
    for rank, out in enumerate(r["bad"] for r in world4[1]):
        for key, (kind, text) in expected.items():
            assert out[key] is not None, f"rank {rank}: {key} raised nothing"
            assert out[key][0] == kind and text in out[key][1], (rank, key, out[key])
