"""``use_decoupled_grad=True`` (megatron_fsdp 0.6.1's ``megatron_fsdp_use_decoupled_grad``):
for precision-aware optimizers (TE's ``FusedAdam(use_decoupled_grad=True)``), the reduced
gradient shard is installed as the optimizer parameters' ``.decoupled_grad``, in the
main grads' own dtype (Megatron-FSDP's ``update_main_grads`` skips the cast to the main
weights' dtype then), and ``.grad`` is left None; ``zero_grad_buffer`` drops
``.decoupled_grad`` as it does there.

- ZeRO-1 and ZeRO-3, 2 ranks: after backward ``.grad`` is None and ``.decoupled_grad``
  holds the gradient of a one-process reference on the whole batch (fp32 within 1e-5);
  with ``main_grads_dtype=torch.bfloat16`` it is bf16 while the main weights are fp32.
- Training with a precision-aware SGD (reads ``.decoupled_grad``) and the wrapper's
  ``clip_grad_norm_`` (which clips ``.decoupled_grad``) matches one process with torch's
  SGD and ``clip_grad_norm_`` step by step (losses, norms, final weights; fp32, 1e-5);
  ``optimizer.zero_grad()`` leaves no ``.decoupled_grad``.
- ``fully_shard`` refuses an optimizer that reads ``.grad`` (it would step nothing), before
  the module is touched.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from fsdp_buffers import MixedPrecisionPolicy
from fsdp_hooks import fully_shard
from fsdp_mesh.testing import run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

WORLD = 2
STEPS = 3
GLOBAL_BATCH = 8
SEQ_LEN = 8
VOCAB = 64
LR = 0.5
MAX_NORM = 2.0  # below the first gradient norms (about 4): clipping acts


class DecoupledSGD(torch.optim.Optimizer):
    """A precision-aware SGD: reads ``.decoupled_grad`` (any dtype), as TE's FusedAdam
    with ``use_decoupled_grad=True`` does."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})
        self.use_decoupled_grad = True

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                grad = getattr(p, "decoupled_grad", None)
                if grad is not None:
                    p.add_(grad.to(p.dtype), alpha=-group["lr"])


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ_LEN, dim=32, n_heads=4, n_layers=2))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def _batch(step: int, rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = token_batch(step, GLOBAL_BATCH, SEQ_LEN, VOCAB, seed=3)
    if rank is None:
        return x, y
    per = GLOBAL_BATCH // WORLD
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _reference() -> dict[str, Any]:
    model = _gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms, grads = [], [], None
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = _loss(model, *_batch(step, None))
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        losses.append(loss.item())
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "grads": grads, "weights": weights}


def _train(strategy: int) -> dict[str, Any]:
    rank = dist.get_rank()
    module = _gpt()
    optimizer = DecoupledSGD(module.parameters(), lr=LR)
    model, optimizer = fully_shard(
        module, optimizer, zero_dp_strategy=strategy, fsdp_unit_modules=[Block],
        use_decoupled_grad=True,
    )  # fmt: skip
    params = [p for g in optimizer.param_groups for p in g["params"]]
    losses, norms, grads, after_zero = [], [], None, None
    for step in range(STEPS):
        optimizer.zero_grad()
        if step == 1:
            after_zero = [getattr(p, "decoupled_grad", None) is None for p in params]
        loss = _loss(model, *_batch(step, rank))
        loss.backward()
        model.finish_grad_sync()
        assert all(p.grad is None for p in params), "use_decoupled_grad leaves .grad None"
        if grads is None:
            names = {id(p): n for n, p in model.named_parameters()}
            grads = {names[id(p)]: p.decoupled_grad.full_tensor() for p in params}
        norms.append(float(model.clip_grad_norm_(MAX_NORM)))
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
    weights = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {
        "losses": losses, "norms": norms, "grads": grads, "weights": weights,
        "after_zero": after_zero,
    }  # fmt: skip


def _bf16_grads() -> dict[str, Any]:
    module = _gpt()
    optimizer = DecoupledSGD(module.parameters(), lr=LR)
    policy = MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16)
    model, optimizer = fully_shard(
        module, optimizer, zero_dp_strategy=3, fsdp_unit_modules=[Block],
        mixed_precision_policy=policy, use_decoupled_grad=True,
    )  # fmt: skip
    _loss(model, *_batch(0, dist.get_rank())).backward()
    model.finish_grad_sync()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {
        "weights": {p.dtype for p in params},
        "grads": {p.decoupled_grad.dtype for p in params},
        "dtensor": all(isinstance(p.decoupled_grad, DTensor) for p in params),
        "grad_none": all(p.grad is None for p in params),
    }


@pytest.mark.parametrize("strategy", [1, 3])
def test_decoupled_grad_trains_like_one_process(strategy):
    ref = _reference()
    for out in run_distributed(_train, WORLD, args=(strategy,), timeout=120):
        assert ref["norms"][0] > MAX_NORM  # clipping acted
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]),
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
        torch.testing.assert_close(torch.tensor(out["norms"]), torch.tensor(ref["norms"]),
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
        for name, value in ref["grads"].items():
            torch.testing.assert_close(out["grads"][name], value, rtol=1e-5, atol=1e-6)
        for name, value in ref["weights"].items():
            torch.testing.assert_close(out["weights"][name], value, rtol=1e-5, atol=1e-6)
        assert out["after_zero"] and all(out["after_zero"])


def test_decoupled_grad_keeps_the_main_grads_dtype():
    for out in run_distributed(_bf16_grads, WORLD, timeout=120):
        assert out == {
            "weights": {torch.float32}, "grads": {torch.bfloat16}, "dtensor": True,
            "grad_none": True,
        }  # fmt: skip


def _refused() -> dict[str, Any]:
    module = _gpt()
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    with pytest.raises(ValueError) as info:
        fully_shard(module, optimizer, fsdp_unit_modules=[Block], use_decoupled_grad=True)
    untouched = not any(isinstance(p, DTensor) for p in module.parameters())
    return {"message": str(info.value), "untouched": untouched}


def test_optimizer_reading_grad_is_refused_with_decoupled_grad():
    for out in run_distributed(_refused, WORLD, timeout=120):
        assert "reads .grad" in out["message"] and "FusedAdam" in out["message"]
        assert out["untouched"]
