"""``fsdp_double_buffer`` under ZeRO-3 (units take turns in two persistent slots) on
models whose units do not simply run once each in build order: a replicated
(``fsdp_no_shard``) unit between sharded ones, units run in reverse order, a unit run
twice (0, 1, 0, 2), a unit skipped, units of unequal sizes, and an embedding unit tied
to the output head (kept gathered all step, so out of the slots). Prefetch must not
take a slot another unit holds, and a bucket that was only prefetched gives its slot
up to one that is needed. World size 2, SGD with momentum, parity with one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from fsdp_buffers import fsdp_no_shard
from fsdp_hooks import fully_shard
from fsdp_mesh.testing import assert_tensors_close, run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

WORLD = 2
CFG = GPTConfig(vocab_size=48, max_seq_len=8, dim=16, n_heads=2, n_layers=3)
GLOBAL_BATCH = 8
STEPS = 3
VARIANTS = ("no_shard_middle", "reversed", "aba", "skip", "unequal", "embedding_unit")


class OrderedGPT(GPT):
    """Runs its blocks in ``order``; ``wide`` makes block 0's MLP four times wider."""

    def __init__(self, order: list[int], wide: bool = False) -> None:
        super().__init__(CFG)
        self.order = order
        if wide:  # block 0's MLP 4x wider: the prefetch budget then spans blocks 1 and 2
            self.blocks[0].mlp[0] = nn.Linear(CFG.dim, 16 * CFG.dim)
            self.blocks[0].mlp[2] = nn.Linear(16 * CFG.dim, CFG.dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for i in self.order:
            x = self.blocks[i](x)
        return self.head(self.ln_f(x))


def _build(variant: str) -> tuple[nn.Module, list[type]]:
    torch.manual_seed(0)
    order = {"reversed": [2, 1, 0], "aba": [0, 1, 0, 2], "skip": [0, 2]}.get(variant, [0, 1, 2])
    model = OrderedGPT(order, wide=variant == "unequal")
    if variant == "no_shard_middle":
        fsdp_no_shard(model.blocks[1])
    units = [Block, nn.Embedding] if variant == "embedding_unit" else [Block]
    return model, units


def _loss(model: nn.Module, step: int, rows: slice) -> torch.Tensor:
    x, y = token_batch(step, GLOBAL_BATCH, CFG.max_seq_len, CFG.vocab_size, seed=3)
    return F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten())


def _reference(variant: str) -> dict[str, torch.Tensor]:
    model, _ = _build(variant)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        _loss(model, step, slice(None)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(variant: str) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    module, units = _build(variant)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    model, opt = fully_shard(
        module, opt, fsdp_unit_modules=units, zero_dp_strategy=3, fsdp_double_buffer=True
    )
    per_rank = GLOBAL_BATCH // WORLD
    for step in range(STEPS):
        _loss(model, step, slice(rank * per_rank, (rank + 1) * per_rank)).backward()
        opt.step()
        opt.zero_grad()
    return model.buffer.views.full_parameters()


@pytest.mark.parametrize("variant", VARIANTS)
def test_double_buffer_zero3_matches_one_process(variant):
    ref = _reference(variant)
    got = run_distributed(_train, WORLD, args=(variant,), timeout=120)[0]
    assert_tensors_close(got, ref, where=variant)
