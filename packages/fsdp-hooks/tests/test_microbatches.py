"""Gradient accumulation across microbatches equals one large batch, for every strategy.

k microbatches per rank, each loss scaled by 1/k, accumulated and then reduced across
the data-parallel ranks, must give the gradient of the mean loss over the whole global
batch (N ranks x k microbatches x m rows), whether the model reduces only on the last
microbatch (``no_sync``, ``set_model_auto_sync``, ``MegatronFSDP``'s deferred default)
or on every one (which must not double-count).
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn import functional as F

from fsdp_hooks import (
    DistributedDataParallelConfig,
    MegatronFSDP,
    fully_shard,
    fully_shard_optimizer,
)
from fsdp_mesh import FSDPDistributedIndex
from fsdp_mesh.testing import run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

CFG = GPTConfig(vocab_size=48, max_seq_len=8, dim=16, n_heads=2, n_layers=2)
K = 3  # microbatches per step
M = 2  # rows per microbatch per rank
STEPS = 2
LR = 0.5


def _global_batch(step, world):
    return token_batch(step, world * K * M, CFG.max_seq_len, CFG.vocab_size)


def _microbatch(x, rank, j):
    start = rank * K * M + j * M
    return x[start : start + M]


def _reference(world):
    """Grads and params after each step of one process on the whole global batch."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    out = []
    for step in range(STEPS):
        x, y = _global_batch(step, world)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out.append((grads, {n: p.detach().clone() for n, p in model.named_parameters()}))
    return out


def _local(full, dtensor, model, name):
    """The rows of the full reference tensor that this rank's DTensor shard holds."""
    placement = dtensor.placements[0]
    if isinstance(placement, Replicate):
        return full
    assert isinstance(placement, Shard) and placement.dim == 0
    r0, r1 = model.buffer.views.local_rows(name)
    return full[r0:r1]


def _assert_matches(model, expected, what, label):
    names = set()
    for name, p in model.module.named_parameters():
        assert isinstance(p, DTensor), f"{label}: {name} is not a DTensor outside forward"
        t = p.grad if what == "grad" else p
        assert t is not None, f"{label}: {name} has no {what}"
        torch.testing.assert_close(
            t.to_local(),
            _local(expected[name], p, model, name),
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, n=name: f"{label}: {what} of {n}: {m}",
        )
        names.add(name)
    assert names == set(expected), f"{label}: parameter names differ"


def _reductions(model):
    stats = model.comm_stats(reset=True)
    return stats["all_reduce"]["calls"] + stats["reduce_scatter"]["calls"]


def _num_trainable_buckets(model):
    return sum(1 for g in model.buffer.groups if g.requires_grad)


def _build(strategy, how):
    torch.manual_seed(0)
    module = GPT(CFG)
    if how == "fully_shard":
        opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9)
        return fully_shard(module, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    model = MegatronFSDP(
        module,
        FSDPDistributedIndex(mesh, dp_shard_dim="dp"),
        ddp_config=DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy),
        fsdp_unit_modules=[Block],
    )
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    return model, fully_shard_optimizer(opt)


def _microbatch_backward(model, x, y, rank, j):
    xb, yb = _microbatch(x, rank, j), _microbatch(y, rank, j)
    loss = F.cross_entropy(model(xb).flatten(0, 1), yb.flatten()) / K
    loss.backward()


def _scenario(strategy, scenario, ref):
    """Run STEPS steps of K microbatches; check grads (before the step, where the
    scenario promises them reduced) and params after each step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    how = "megatron" if scenario.startswith("megatron") else "fully_shard"
    model, opt = _build(strategy, how)
    assert model.model_auto_sync is (how == "fully_shard")
    nb = _num_trainable_buckets(model)
    replicated_grads = strategy in (0, 1)
    label = f"strategy {strategy}, {scenario}"
    for step in range(STEPS):
        x, y = _global_batch(step, world)
        model.comm_stats(reset=True)
        for j in range(K):
            last = j == K - 1
            if scenario == "no_sync_first":
                if last:
                    _microbatch_backward(model, x, y, rank, j)
                else:
                    with model.no_sync():
                        _microbatch_backward(model, x, y, rank, j)
                    assert model.sync_grads  # the context manager restored auto sync
            elif scenario == "auto_sync_toggle":
                model.set_model_auto_sync(last)
                _microbatch_backward(model, x, y, rank, j)
            elif scenario == "megatron_sync_last":
                if last:
                    with model.sync():
                        _microbatch_backward(model, x, y, rank, j)
                    assert not model.sync_grads
                else:
                    _microbatch_backward(model, x, y, rank, j)
            else:  # "sync_every" (fully_shard default) and "megatron_deferred"
                _microbatch_backward(model, x, y, rank, j)
        calls = _reductions(model)
        grads, params = ref[step]
        if scenario == "megatron_deferred" and replicated_grads:
            # Nothing reduced in backward: finish_grad_sync (in optimizer.step) does it.
            assert calls == 0, f"{label}: {calls} reductions during deferred backwards"
            model.comm_stats(reset=True)
            opt.step()
            assert _reductions(model) == nb, f"{label}: step did not reduce each bucket once"
            _assert_matches(model, grads, "grad", f"{label}, step {step}")
        else:
            # Sharded grads are reduce-scattered every backward; replicated ones only
            # on synced backwards.
            synced = K if (not replicated_grads or scenario == "sync_every") else 1
            if scenario == "megatron_deferred":
                synced = K
            assert calls == synced * nb, f"{label}: {calls} reductions, expected {synced * nb}"
            if scenario == "megatron_deferred":
                # Megatron-FSDP: with auto sync off, .grad stays empty until
                # finish_grad_sync(), even where each backward reduce-scattered.
                assert all(p.grad is None for p in model.parameters()), label
                model.finish_grad_sync()
            _assert_matches(model, grads, "grad", f"{label}, step {step}")
            opt.step()
            assert _reductions(model) == 0, f"{label}: the step reduced again"
        _assert_matches(model, params, "param", f"{label}, step {step}")
        opt.zero_grad()
    return True


def _run_all(strategy):
    ref = _reference(dist.get_world_size())
    for scenario in (
        "no_sync_first",
        "sync_every",
        "auto_sync_toggle",
        "megatron_deferred",
        "megatron_sync_last",
    ):
        _scenario(strategy, scenario, ref)
    return True


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_accumulated_microbatches_equal_one_large_batch(strategy):
    assert run_distributed(_run_all, 2, args=(strategy,)) == [True, True]
