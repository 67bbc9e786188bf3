"""The hook layer's runtime steps show in a torch.profiler trace (``fsdp_buffers.profiling``),
with the profiler started after the model has already run steps without it: the ranges
made once and reused (by the hooks, the unit groups, the buckets, the pipelines and the
buffer) still open while a profiler records, and a step after the profiler stopped
still trains."""

from __future__ import annotations

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from fsdp_hooks import fully_shard
from fsdp_mesh.testing import run_distributed

UNITS = 3


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(self.norm(x)))


def _step(model, opt, seed: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _profiled() -> dict[str, int]:
    torch.manual_seed(0)
    module = nn.Sequential(*[_Block() for _ in range(UNITS)])
    model, opt = fully_shard(
        module,
        torch.optim.Adam(module.parameters(), lr=0.01),
        fsdp_unit_modules=[_Block],
        zero_dp_strategy=3,
        suggested_communication_unit_size=0,  # one bucket per unit
    )
    _step(model, opt, 0)  # no profiler: every range is made and used idle first
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(model, opt, 1)
    _step(model, opt, 2)
    return {e.key: e.count for e in prof.key_averages() if e.key.startswith("fsdp.")}


def test_hook_and_bucket_ranges_show_when_profiling_starts_later():
    for counts in run_distributed(_profiled, 2, timeout=120):
        for label in ("fsdp.pre_forward", "fsdp.post_forward", "fsdp.pre_backward"):
            assert counts.get(label) == UNITS, (label, counts)
        # The first unit's input needs no gradient: the end of backward stands in for
        # its post-backward.
        assert counts.get("fsdp.post_backward") == UNITS - 1, counts
        for gid in range(UNITS):  # gathered for forward and again for backward
            assert counts.get(f"fsdp.all_gather.{gid}") == 2, (gid, counts)
            for prefix in ("fsdp.release.", "fsdp.reduce."):
                assert f"{prefix}{gid}" in counts, (prefix, gid, counts)
            assert counts.get(f"fsdp.copy_in.{gid}") == 1, (gid, counts)  # one reduction
        assert "fsdp.wait" in counts, counts
        # Once a step each: the root hooks, the end of backward, and the optimizer's calls.
        for label in (
            "fsdp.root_pre_forward",
            "fsdp.root_post_forward",
            "fsdp.end_of_backward",
            "fsdp.finish_grad_sync",
            "fsdp.install_optimized_model_weights",
            "fsdp.zero_grad_buffer",
        ):
            assert counts.get(label) == 1, (label, counts)
