"""Which functions, in which files, one ZeRO-3 training step of fsdp calls, beside FSDP2.

``docs/design.md``'s walk ("One ZeRO-3 step, function by function") names the code a
step runs; this counts it. A profile hook (``sys.setprofile``) on rank 0 of world 2
(gloo) records every Python function called during the third step (forward, backward,
``optimizer.step()``, ``zero_grad()``) whose file is in one of fsdp's packages, or, for
FSDP2, in ``torch/distributed/fsdp/_fully_shard/``, and how many calls they took (the
Python calls a step makes in the library: host time per step on a GPU is mostly these).
Properties and closures count;
comprehensions, generator expressions and lambdas do not. torch's optimizer step is
counted for neither. The model: three units of ``Linear(128, 512)`` + ``Linear(512,
128)`` between two root ``Linear``s, SGD, one unit per communication unit.

    uv run python -m benchmarks.step_trace
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter, defaultdict
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

DIM, HIDDEN, UNITS, BATCH, STEPS = 128, 512, 3, 8, 3
_SKIPPED = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>")


class _Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.units = nn.ModuleList(_Unit() for _ in range(UNITS))
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for unit in self.units:
            h = unit(h)
        return self.out(h)


def _roots(library: str) -> tuple[str, ...]:
    """The source folders whose functions are counted."""
    if library == "fsdp2":
        import torch.distributed.fsdp._fully_shard as fully_shard_pkg

        return (os.path.dirname(fully_shard_pkg.__file__),)
    import fsdp_buffers
    import fsdp_hooks
    import fsdp_mesh

    return tuple(os.path.dirname(m.__file__) for m in (fsdp_buffers, fsdp_hooks, fsdp_mesh))


def _wrap(library: str, module: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    if library == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for unit in module.units:
            fully_shard(unit)
        fully_shard(module)
        return module, torch.optim.SGD(module.parameters(), lr=0.01)
    from fsdp_hooks import fully_shard

    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    return fully_shard(
        module,
        optimizer,
        fsdp_unit_modules=[_Unit],
        zero_dp_strategy=3,
        suggested_communication_unit_size=0,
    )


def trace_rank(library: str) -> dict[str, dict[str, int]]:
    """On each rank: train ``STEPS`` steps, profiling the last; rank 0's functions by
    file (relative to their package folder), each with its number of calls."""
    torch.manual_seed(0)
    model, optimizer = _wrap(library, _Model())
    roots = _roots(library)
    called: dict[str, Counter[str]] = defaultdict(Counter)

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code.co_name in _SKIPPED:
            return
        for root in roots:
            if code.co_filename.startswith(root):
                rel = os.path.relpath(code.co_filename, os.path.dirname(root))
                called[rel][code.co_qualname] += 1
                return

    x = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(dist.get_rank()))
    for step in range(STEPS):
        if step == STEPS - 1:
            sys.setprofile(profile)
        try:
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        finally:
            sys.setprofile(None)
    return {f: dict(sorted(fns.items())) for f, fns in sorted(called.items())}


def main() -> None:
    from fsdp_mesh.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print every function")
    args = parser.parse_args()
    for library in ("fsdp", "fsdp2"):
        files = run_distributed(trace_rank, 2, args=(library,), timeout=120, device_type="cpu")[0]
        total = sum(len(fns) for fns in files.values())
        calls = sum(sum(fns.values()) for fns in files.values())
        print(f"{library}: {total} functions in {len(files)} files, {calls} calls")
        for name, fns in files.items():
            print(f"  {len(fns):4d} functions {sum(fns.values()):5d} calls  {name}")
            if args.list:
                for fn, n in fns.items():
                    print(f"          {n:5d}  {fn}")


if __name__ == "__main__":
    main()
