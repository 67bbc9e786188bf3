"""The ``main_grad`` protocol through ``fully_shard``: a layer that adds its weight
gradient straight into ``weight.main_grad`` and sets ``grad_added_to_main_grad``
(Megatron-Core's gradient-accumulation fusion, Transformer Engine's fused wgrad), in
FSDP units and outside them (a root parameter), trains under every strategy at world
size 2 exactly like the same model with plain layers in one process: ``main_grad``
exists whenever backward reaches a layer, also where gradients are sharded and staged
only during backward (ZeRO-2/3)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from fsdp_hooks import fully_shard
from fsdp_mesh.testing import assert_tensors_close, mean_over_ranks, run_distributed
from fsdp_mesh.testing.models import FusedWeightGradLinear

WORLD = 2
VOCAB, DIM, SEQ = 32, 16, 6
ROWS = 4  # per rank per step
STEPS = 3
LR = 1e-2


def _linear(x: torch.Tensor, weight: torch.Tensor, fused: bool) -> torch.Tensor:
    return FusedWeightGradLinear.apply(x, weight) if fused else x @ weight.t()


class Block(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(DIM, DIM) * 0.3)
        self.ln = nn.LayerNorm(DIM)
        self.fused = fused

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(_linear(self.ln(h), self.w, self.fused))


class Net(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(fused) for _ in range(2))
        self.head = nn.Parameter(torch.randn(VOCAB, DIM) * 0.3)  # outside every unit
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return _linear(h, self.head, self.fused)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (WORLD * ROWS, SEQ), generator=g)
    return x, torch.randint(0, VOCAB, (WORLD * ROWS, SEQ), generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = Net(fused=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = _loss(model, *_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train() -> dict:
    rank = dist.get_rank()
    out = {}
    for strategy in (0, 1, 2, 3):
        module = Net(fused=True)
        opt = torch.optim.AdamW(module.parameters(), lr=LR)
        model, opt = fully_shard(
            module,
            opt,
            fsdp_unit_modules=[Block],
            zero_dp_strategy=strategy,
            grad_staging="main_grad",
        )
        losses = []
        for step in range(STEPS):
            x, y = _batch(step)
            mine = slice(rank * ROWS, (rank + 1) * ROWS)
            loss = _loss(model, x[mine], y[mine])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(mean_over_ranks(loss))
        out[strategy] = (losses, model.buffer.views.full_parameters())
    return out


def test_fused_weight_grads_into_main_grad_under_every_strategy():
    ref_losses, ref_params = _reference()
    results = run_distributed(_train, WORLD, timeout=120)
    for strategy in (0, 1, 2, 3):
        losses, params = results[0][strategy]
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0, msg=str(strategy))
        assert_tensors_close(params, ref_params, where=f"strategy {strategy}")
