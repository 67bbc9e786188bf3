"""How reduced gradients are scaled: a mean over data-parallel ranks by default, a sum
with ``calculate_per_token_loss``, the same mean with ``average_in_collective``, and
``scale_gradients(f)`` on top.

``average_in_collective`` must change the collective, not only give the same result:
by default each rank multiplies its gradients by 1/N and the collective sums them
(``ReduceOp.SUM``); with the flag the collective averages them (``ReduceOp.AVG``, which
gloo supports as well as NCCL) and the input is not pre-divided. The reduction calls are
recorded (op and input) inside the ranks to show it.

Each rank feeds different data, so the local gradients differ; the expected values
are built from every rank's local gradient, computed by a plain (unwrapped) copy of
the model on that rank's data.
"""

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate
from torch.nn import functional as F

from fsdp_hooks import fully_shard
from fsdp_mesh.testing import run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

CFG = GPTConfig(vocab_size=40, max_seq_len=8, dim=16, n_heads=2, n_layers=2)
ROWS = 2


def _data(rank, micro=0):
    # Different tokens on every rank (and microbatch): the local gradients differ.
    return token_batch(100 * rank + micro, ROWS, CFG.max_seq_len, CFG.vocab_size, seed=7)


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _local_grads(rank, micro=0):
    """The gradient rank ``rank`` computes on its own data, without any reduction."""
    torch.manual_seed(0)
    model = GPT(CFG)
    _loss(model, *_data(rank, micro)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _combine(per_rank, weight):
    return {n: weight * sum(g[n] for g in per_rank) for n in per_rank[0]}


def _check(model, expected, label):
    for name, p in model.module.named_parameters():
        local = p.grad.to_local()
        full = expected[name]
        if not isinstance(p.grad.placements[0], Replicate):
            r0, r1 = model.buffer.views.local_rows(name)
            full = full[r0:r1]
        torch.testing.assert_close(
            local, full, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{label}: {n}: {m}"
        )


@contextlib.contextmanager
def _recording_reductions(record: list) -> Iterator[None]:
    """Record (kind, op, copy of the input) of every gradient reduction fsdp issues:
    ``reduce_scatter_tensor`` (sharded grads or main weights) or ``all_reduce``."""
    reduce_scatter, all_reduce = dist.reduce_scatter_tensor, dist.all_reduce

    def recording_reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        record.append(("reduce_scatter", op, input.detach().clone()))
        return reduce_scatter(output, input, op=op, group=group, async_op=async_op)

    def recording_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if tensor.is_floating_point():  # not the flags of which parameters got a gradient
            record.append(("all_reduce", op, tensor.detach().clone()))
        return all_reduce(tensor, op=op, group=group, async_op=async_op)

    dist.reduce_scatter_tensor = recording_reduce_scatter
    dist.all_reduce = recording_all_reduce
    try:
        yield
    finally:
        dist.reduce_scatter_tensor, dist.all_reduce = reduce_scatter, all_reduce


def _train_one(strategy, micro=1, scale=None, record=None, **kwargs):
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = GPT(CFG)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    model, opt = fully_shard(
        module, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy, **kwargs
    )
    for j in range(micro):  # every microbatch synced (the fully_shard default)
        loss = _loss(model, *_data(rank, j))
        with _recording_reductions(record) if record is not None else contextlib.nullcontext():
            loss.backward()
    if scale is not None:
        model.scale_gradients(scale)
    return model


def _check_division_in_collective(strategy, mean, total):
    """The same reductions, with the op and the pre-division moved (see the docstring)."""
    world = dist.get_world_size()
    runs = {}
    for label, kwargs in (
        ("default", {}),
        ("average_in_collective", {"average_in_collective": True}),
        ("per-token", {"calculate_per_token_loss": True}),
        ("per-token, average_in_collective", {
            "calculate_per_token_loss": True, "average_in_collective": True,
        }),
    ):  # fmt: skip
        record: list = []
        model = _train_one(strategy, record=record, **kwargs)
        _check(model, total if "per-token" in label else mean, label)
        runs[label] = record
    kind = "all_reduce" if strategy == 0 else "reduce_scatter"
    nb = sum(1 for g in model.buffer.groups if g.requires_grad)
    # (expected op, what the input was multiplied by, relative to the default's input)
    expected = {
        "default": (dist.ReduceOp.SUM, 1.0),  # the default pre-divides by N
        "average_in_collective": (dist.ReduceOp.AVG, world),  # not pre-divided
        "per-token": (dist.ReduceOp.SUM, world),  # a sum: nothing to divide
        "per-token, average_in_collective": (dist.ReduceOp.AVG, world * world),
    }
    default_inputs = [t for _k, _op, t in runs["default"]]
    assert any(t.abs().sum() > 0 for t in default_inputs)
    for label, (op, factor) in expected.items():
        record = runs[label]
        assert [k for k, _op, _t in record] == [kind] * nb, (label, record)
        assert all(o == op for _k, o, _t in record), (label, [o for _k, o, _t in record])
        for (_k, _o, sent), base in zip(record, default_inputs, strict=True):
            torch.testing.assert_close(
                sent, base * factor, rtol=1e-6, atol=0, msg=lambda m, lb=label: f"{lb}: {m}"
            )


def _body(strategy):
    world = dist.get_world_size()
    per_rank = [_local_grads(r) for r in range(world)]
    mean = _combine(per_rank, 1.0 / world)
    total = _combine(per_rank, 1.0)
    # The local gradients really differ, so mean and sum differ from any one of them.
    assert not torch.allclose(per_rank[0]["tok.weight"], per_rank[1]["tok.weight"])

    # The default (mean), per-token (sum) and average_in_collective, with their
    # collectives.
    _check_division_in_collective(strategy, mean, total)
    _check(_train_one(strategy, scale=0.25), _combine(per_rank, 0.25 / world), "scale 0.25")
    _check(
        _train_one(strategy, scale=3.0, calculate_per_token_loss=True),
        _combine(per_rank, 3.0),
        "per-token, scale 3",
    )
    # Two microbatches, each synced: the second reduction must not re-scale (or
    # re-sum) what the first one already reduced, also when summing.
    two = [_local_grads(r, 0) for r in range(world)] + [_local_grads(r, 1) for r in range(world)]
    _check(_train_one(strategy, micro=2), _combine(two, 1.0 / world), "2 microbatches, mean")
    _check(
        _train_one(strategy, micro=2, calculate_per_token_loss=True),
        _combine(two, 1.0),
        "2 microbatches, sum",
    )
    _check(
        _train_one(strategy, micro=2, average_in_collective=True),
        _combine(two, 1.0 / world),
        "2 microbatches, average_in_collective",
    )
    return True


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_gradient_scaling(strategy):
    assert run_distributed(_body, 2, args=(strategy,)) == [True, True]
