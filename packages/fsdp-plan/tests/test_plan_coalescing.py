"""Peak gathered bytes under unit coalescing (``suggested_communication_unit_size``) and
``prefetch_depth``, measured on the real wrapped model (``GatheredMeter`` of
``test_plan_gathered_peak``: every storage holding gathered weights right after each
all-gather), against the bound of docs/guide/coalescing.md and against ``plan()``.

The bound (docs/guide/coalescing.md, "Unit coalescing and prefetch depth"), ZeRO-3 without double buffer:
``peak ≤ R + (c + d) · G``, where ``R`` is the root buckets' unsharded bytes, ``G``
the largest communication unit's (an FSDP unit, or the units coalesced into one),
``d`` the prefetch depth and ``c`` 2 when an all-gather writes a rank-major copy before
the copy-out (1 when the bucket is rank-major already): the group in use, the ``d``
prefetched ones' rank-major copies in flight, and while a group is copied out, its
copy besides its bucket. Uneven units (widths vary) make ``G`` differ across groups.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_buffers import collectives
from fsdp_hooks import fully_shard
from fsdp_mesh.testing import run_distributed
from fsdp_plan import plan

WIDTHS = (8, 16, 16, 24, 8, 16, 32, 8, 16)


class Layer(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_in)
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTHS[0], WIDTHS[0])  # a root bucket
        self.layers = nn.ModuleList(Layer(a, b) for a, b in itertools.pairwise(WIDTHS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x


# (suggested_communication_unit_size, prefetch_depth)
# 0: no coalescing; None: fully_shard's default (pairs of units under 65,536 elements)
OPTIONS = [(0, 0), (0, 1), (0, 2), (600, 1), (600, 2), (1500, 1), (1500, 3), (10**6, 1), (None, 1)]


def _measure(options):
    # The spawned ranks import this file's neighbour too.
    sys.path.insert(0, str(Path(__file__).parent))
    from test_plan_gathered_peak import GatheredMeter

    out = []
    original = collectives.all_gather
    for size, depth in options:
        torch.manual_seed(0)
        module = Net()
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        model, opt = fully_shard(
            module,
            opt,
            fsdp_unit_modules=[Layer],
            suggested_communication_unit_size=size,
            prefetch_depth=depth,
        )
        meter = GatheredMeter(model.buffer)
        collectives.all_gather = meter.observe(original)
        try:
            for step in range(2):
                meter.peak = 0  # the second step is the one measured
                g = torch.Generator().manual_seed(10 * step + dist.get_rank())
                model(torch.randn(3, WIDTHS[0], generator=g)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        finally:
            collectives.all_gather = original
        buffer = model.buffer
        root = set(buffer.root_groups)
        per_group: dict[int, int] = {}
        rank_major = True
        for b in buffer.buckets:
            if b.is_distributed and b.gid not in root:
                key = b.group.fsdp_unit_id
                per_group[key] = per_group.get(key, 0) + b.unsharded_bytes
                mw = b.group.model_weight_buffer
                rank_major &= mw.layout.is_rank_major(mw.coarse)
        out.append(
            dict(
                peak=meter.peak,
                root=sum(buffer.buckets[g].unsharded_bytes for g in root),
                largest=max(per_group.values()),
                groups=len(per_group),
                copy=1 if rank_major else 2,
            )
        )
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_peak_gathered_bytes_within_the_bound_and_planned(world_size):
    measured = run_distributed(_measure, world_size, args=(OPTIONS,), timeout=120)
    peaks = {}
    for (size, depth), got in zip(OPTIONS, measured[0], strict=True):
        where = f"world {world_size}, size {size}, depth {depth}: {got}"
        bound = got["root"] + (got["copy"] + depth) * got["largest"]
        assert 0 < got["peak"] <= bound, where
        # Not vacuous: the group in use (and the root) are held at once.
        assert got["peak"] >= got["root"] + got["largest"], where
        for rank_results in measured[1:]:
            assert rank_results[OPTIONS.index((size, depth))]["peak"] == got["peak"], where
        with torch.device("meta"):
            meta = Net()
        p = plan(
            meta,
            world_size,
            fsdp_unit_modules=[Layer],
            suggested_communication_unit_size=size,
            prefetch_depth=depth,
        )
        planned = p.per_rank["gathered_peak"]
        assert abs(planned - got["peak"]) <= 0.01 * got["peak"], f"{where}, planned {planned}"
        peaks[(size, depth)] = got
    # The options change what is held: deeper prefetch and bigger groups hold more.
    assert peaks[(0, 0)]["peak"] < peaks[(0, 1)]["peak"] < peaks[(0, 2)]["peak"]
    assert peaks[(0, 1)]["peak"] < peaks[(600, 1)]["peak"] < peaks[(1500, 1)]["peak"]
    assert peaks[(10**6, 1)]["groups"] == 1
    units = len(WIDTHS) - 1
    assert peaks[(None, 1)]["groups"] == (units + 1) // 2  # the default pairs small units
    assert peaks[(600, 1)]["groups"] < len(WIDTHS) - 1
