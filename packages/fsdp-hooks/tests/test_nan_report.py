"""``report_nan_in_param_grad=True``: a NaN or Inf gradient on one rank only raises, on
every rank and without a hang, a RuntimeError naming the parameters and the rank."""

import math

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from fsdp_hooks import TrainingState, fully_shard
from fsdp_mesh.testing import run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

CFG = GPTConfig(vocab_size=32, max_seq_len=8, dim=16, n_heads=2, n_layers=2)


def _build(strategy, report):
    torch.manual_seed(0)
    module = GPT(CFG)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    return fully_shard(
        module,
        opt,
        fsdp_unit_modules=[Block],
        zero_dp_strategy=strategy,
        report_nan_in_param_grad=report,
    )


def _backward(model, poison=None):
    """One backward on this rank's data; ``poison=(name, value)`` sets one element of
    that parameter's local gradient to ``value`` (a hook on the compute parameter,
    which runs before the gradient is accumulated and handed to fsdp)."""
    rank = dist.get_rank()
    x, y = token_batch(rank, 2, CFG.max_seq_len, CFG.vocab_size)
    handle = None
    if poison is not None:
        name, value = poison
        param = next(p for n, _g, _i, p in model.buffer.named_params() if n == name)

        def corrupt(grad):
            grad = grad.clone()
            grad.view(-1)[0] = value
            return grad

        handle = param.register_hook(corrupt)
    try:
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    finally:
        if handle is not None:
            handle.remove()


def _poisoned_step_raises(model, opt, bad_rank, name, value):
    rank = dist.get_rank()
    poison = (name, value) if rank == bad_rank else None
    with pytest.raises(RuntimeError) as info:
        _backward(model, poison)
    message = str(info.value)
    assert "NaN or Inf" in message
    assert f"rank {bad_rank}: ['{name}']" in message, message
    other = 1 - bad_rank
    assert f"rank {other}:" not in message, message
    # Everything was released and reset: the model is usable again.
    assert model.training_state is TrainingState.IDLE
    assert all(u.state is TrainingState.IDLE for u in model.hooks.units)
    assert model.all_gather_pipeline.gathered_buckets() == []
    opt.zero_grad()
    _backward(model)  # a clean step after the failed one does not raise
    opt.step()
    opt.zero_grad()


def _body(strategy):
    model, opt = _build(strategy, report=True)
    _poisoned_step_raises(model, opt, 1, "ln_f.weight", math.nan)
    _poisoned_step_raises(model, opt, 0, "blocks.1.mlp.0.bias", math.inf)
    _poisoned_step_raises(model, opt, 1, "tok.weight", -math.inf)  # tied to head.weight

    # Without the flag: no error, the non-finite values simply flow into the grads.
    model, opt = _build(strategy, report=False)
    rank = dist.get_rank()
    _backward(model, ("ln_f.weight", math.nan) if rank == 1 else None)
    grad = model.module.ln_f.weight.grad.full_tensor()
    assert torch.isnan(grad).any()
    opt.step()
    return True


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_nonfinite_grad_on_one_rank_raises_on_every_rank(strategy):
    assert run_distributed(_body, 2, args=(strategy,), timeout=60) == [True, True]
