"""A checkpoint moves between world sizes, strategies and wrappers mid-training, and the
losses are those of one uninterrupted run: 4 ranks under ZeRO-3, then 2 ranks under
ZeRO-1, then one process (our wrapper at world size 1, and the plain module with a
plain AdamW). Model, optimizer state and the step travel through the checkpoints."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from fsdp_ckpt import load_checkpoint, save_checkpoint
from fsdp_hooks import fully_shard
from fsdp_mesh.testing import harness_device, harness_device_type, run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

# Runs on CUDA + NCCL under --fsdp-device cuda (root conftest.py).
pytestmark = pytest.mark.cuda

CFG = GPTConfig()
GLOBAL_BATCH = 4
STEPS = 6


def _device() -> torch.device:
    """Where this process trains: a rank on its own device; the test process (the
    one-process runs) on the device type the ranks use, so that both run the same
    kernels, as the 1e-6 comparison assumes (CPU and CUDA kernels round differently)."""
    return harness_device() if dist.is_initialized() else torch.device(harness_device_type())


def _fresh(seed: int) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPT(CFG).to(_device())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model, opt, start: int, stop: int) -> list[float]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    b = GLOBAL_BATCH // world
    losses = []
    for step in range(start, stop):
        x, y = token_batch(step, GLOBAL_BATCH, CFG.max_seq_len, CFG.vocab_size, device=_device())
        x, y = x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _phase(load_from: str | None, save_to: str | None, strategy: int, start: int, stop: int):
    # A different seed when loading: every value must come from the checkpoint.
    module, opt = _fresh(0 if load_from is None else 1234)
    model, opt = fully_shard(module, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    if load_from is not None:
        extra = load_checkpoint(load_from, model, opt)
        assert extra == {"step": start, "note": "resharding"}, extra
    losses = _train(model, opt, start, stop)
    if save_to is not None:
        save_checkpoint(save_to, model, opt, extra={"step": stop, "note": "resharding"})
    return losses


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_reshard_4_zero3_to_2_zero1_to_one_process(tmp_path):
    module, opt = _fresh(0)
    reference = _train(module, opt, 0, STEPS)

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    losses = run_distributed(_phase, 4, args=(None, a, 3, 0, 2))[0]
    losses += run_distributed(_phase, 2, args=(a, b, 1, 2, 4))[0]

    # Our wrapper in a world of one...
    wrapped = run_distributed(_phase, 1, args=(b, None, 3, 4, STEPS))[0]
    # ...and the plain module with a plain AdamW, no process group at all.
    module, opt = _fresh(99)
    extra = load_checkpoint(b, module, opt)
    assert extra == {"step": 4, "note": "resharding"}
    assert all(state["step"].item() == 4 for state in opt.state.values())
    plain = _train(module, opt, 4, STEPS)

    assert _rel(losses + wrapped, reference) < 1e-6, (losses + wrapped, reference)
    assert _rel(losses + plain, reference) < 1e-6, (losses + plain, reference)
