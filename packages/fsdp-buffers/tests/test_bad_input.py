"""Bad or unusual input to the buffer layer: mixed devices, meta parameters, integer
parameters, zero-size parameters, tied parameters, unknown strategy names. Errors must
be raised on every rank (each rank asserts them itself), never a hang; unusual
parameters must train correctly (parity with one process over the whole batch)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_mesh
from fsdp_buffers import (
    AllGatherPipeline,
    GradReducePipeline,
    ParamAndGradBuffer,
    ShardingStrategy,
)
from fsdp_buffers.collectives import CollectiveKind
from fsdp_mesh.testing import run_distributed

STRATEGIES = [0, 1, 2, 3]


class Block(nn.Module):
    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class EmptyBlock(nn.Module):
    """A unit whose only parameter has no elements: a bucket of zero bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(0, 6))

    def forward(self, x):
        return x + self.w.sum()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.blocks = nn.ModuleList([Block(), EmptyBlock(), Block()])
        self.empty = nn.Parameter(torch.zeros(0, 3))  # zero-size, outside units
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: one parameter, two modules
        self.steps = nn.Parameter(torch.arange(6).reshape(2, 3), requires_grad=False)
        self.blocks[0].count = nn.Parameter(torch.tensor([7, 8, 9]), requires_grad=False)

    def forward(self, idx):
        h = self.emb(idx) + self.empty.sum()
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _index():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    return fsdp_mesh.FSDPDistributedIndex(mesh, dp_shard_dim="dp")


def _buffer(model, index, strategy=3, **kwargs):
    return ParamAndGradBuffer(
        model, index, strategy=strategy, fsdp_unit_modules=[Block, EmptyBlock], **kwargs
    )


def _bad_input():
    index = _index()
    # A meta parameter when meta init was not asked for: named, with what to do.
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, device="meta"))
    with pytest.raises(
        ValueError,
        match=r"parameters \['1.weight', '1.bias'\] are on the meta device; materialize the "
        r"model first, or ask for meta-device initialization",
    ):
        ParamAndGradBuffer(model, index)
    # Unknown strategy names, unknown unit classes, bad sizes: every rank raises.
    with pytest.raises(
        ValueError, match=r"Invalid sharding strategy 'zero4'.*'optim_grads_params'"
    ):
        ParamAndGradBuffer(nn.Linear(2, 2), index, strategy="zero4")
    with pytest.raises(ValueError, match=r"Conv2d matches no submodule.*Linear"):
        ParamAndGradBuffer(nn.Linear(2, 2), index, fsdp_unit_modules=[nn.Conv2d])
    with pytest.raises(ValueError, match=r"bucket_size must be a positive number"):
        ParamAndGradBuffer(nn.Linear(2, 2), index, bucket_size=0)
    # Nothing above left a rank behind: the next collective still matches up.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    return dist.get_rank()


def test_bad_input_raises_on_every_rank():
    assert run_distributed(_bad_input, 2, timeout=60) == [0, 1]


def _mixed_devices():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, device="cuda"))
    with pytest.raises(
        ValueError, match=r"parameters are on different devices \['cpu', 'cuda:0'\]"
    ):
        ParamAndGradBuffer(model, _index())
    return dist.get_rank()


@pytest.mark.cuda  # runs under --fsdp-device cuda (scripts/gpu-check)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_parameters_on_different_devices():
    assert run_distributed(_mixed_devices, 1, device_type="cpu") == [0]


def test_unknown_strategy_name_lists_the_allowed_names():
    with pytest.raises(ValueError, match=r"Invalid sharding strategy 'zero_4'") as info:
        ShardingStrategy.parse("zero_4")
    for allowed in ("'no_shard'", "'optim'", "'optim_grads'", "'optim_grads_params'", "'zero3'"):
        assert allowed in str(info.value)


def _data(step, world, b=2):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 10, (world * b, 4), generator=g), torch.randn(
        world * b, 4, 10, generator=g
    )


def _train(strategy):
    """Two AdamW steps with integer, zero-size and tied parameters, against one process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    ints = {"steps": model.steps.detach().clone(), "blocks.0.count": torch.tensor([7, 8, 9])}
    initial_emb = model.emb.weight.detach().clone()
    buf = _buffer(model, _index(), strategy)
    # Counted once: the tied weight is one parameter under its first name.
    names = [n for g in buf.groups for n in g.names]
    assert len(names) == len(set(names)) == len(list(model.parameters()))
    assert "emb.weight" in names and "head.weight" not in names
    opt_names = [n for n, _ in buf.views.optimizer_named_parameters()]
    assert "head.weight" not in opt_names and "emb.weight" in opt_names
    # Integer parameters: replicated, frozen, no gradient buffer, not optimized.
    for name in ints:
        gid = next(g for n, g, _i, _p in buf.named_params() if n == name)
        group = buf.groups[gid]
        assert group.fsdp_no_shard and not group.requires_grad
        assert group.main_grad_buffer is None and group.main_weight_buffer is None
        assert not group.model_weight_buffer.is_data_distributed
        assert name not in opt_names
    assert not hasattr(model.steps, "main_grad")
    # The zero-size unit is a bucket of zero elements.
    empty_gid = buf.groups_of_unit(1)
    assert [buf.buckets[g].layout.total_numel for g in empty_gid] == [0]

    ag, gr = AllGatherPipeline(buf), GradReducePipeline(buf)
    gr.register_grad_hooks()
    opt = torch.optim.AdamW([p for _, p in buf.views.optimizer_named_parameters()], lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    trainable = sum(g.requires_grad for g in buf.groups)
    for step in range(2):
        buf.stats.reset()
        idx, y = _data(step, world)
        ag.all_gather_params(range(buf.num_buckets))
        out = model(idx[2 * rank : 2 * rank + 2])
        nn.functional.mse_loss(out, y[2 * rank : 2 * rank + 2]).backward()
        gr.finish()
        ag.reset()
        reduces = buf.stats[CollectiveKind.REDUCE_SCATTER].calls
        reduces += buf.stats[CollectiveKind.ALL_REDUCE].calls
        assert reduces == trainable < buf.num_buckets  # integer buckets are never reduced
        assert model.steps.grad is None
        opt.step()
        buf.install_optimized_model_weights()
        opt.zero_grad(set_to_none=False)
        buf.zero_grad_buffer()
        nn.functional.mse_loss(ref(idx), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    ag.all_gather_params(range(buf.num_buckets))
    assert model.head.weight is model.emb.weight  # still tied
    for (name, p), (ref_name, r) in zip(
        model.named_parameters(), ref.named_parameters(), strict=True
    ):
        assert name == ref_name
        assert p.shape == r.shape, name
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6, msg=f"strategy {strategy} {name}")
    for name, value in ints.items():
        assert torch.equal(dict(model.named_parameters())[name], value), name
    assert model.empty.shape == (0, 3) and model.blocks[1].w.shape == (0, 6)
    # Both modules see the updated weight, and it is not the initial one.
    idx = torch.arange(10)
    assert torch.equal(model.emb(idx), model.head.weight)
    assert not torch.equal(model.emb.weight, initial_emb)
    ag.reset()
    return rank


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_integer_zero_size_and_tied_parameters_train_correctly(strategy):
    assert run_distributed(_train, 2, args=(strategy,), timeout=60) == [0, 1]
