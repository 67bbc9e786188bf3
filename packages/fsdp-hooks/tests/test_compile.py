"""torch.compile with fsdp: fsdp's hooks (gather before, release after, gradient
reduction) run with dynamo skipping their frames, so they stay outside the graph and
break nothing, whether a unit's ``forward`` is compiled
(``block.forward = torch.compile(block.forward)``) or the unit module is
(``block.compile()``, docs/guide/compile.md's pattern, which compiles ``_call_impl``, hooks included).

Checked at world size 2: ``torch._dynamo.explain`` of a unit's forward, run while the unit
is gathered, reports zero graph breaks and one graph (ZeRO-3); with ``unit.compile()``
dynamo's graph-break counter stays empty and it compiles at most one graph per unit
(ZeRO-2 and ZeRO-3); training with the compiled units matches the same model trained
eagerly step by step (fp32 within 1e-5).
``aot_eager`` traces through AOTAutograd like inductor does, without a C++ toolchain.
"""

from __future__ import annotations

from typing import Any

import torch
import torch._dynamo
from torch.nn import functional as F

from fsdp_hooks import fully_shard_model
from fsdp_mesh.testing import assert_tensors_close, run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

CFG = GPTConfig(vocab_size=64, max_seq_len=8, dim=32, n_heads=4, n_layers=2)
STEPS = 3


def _train(compiled: bool) -> tuple[list[float], dict[str, Any]]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = fully_shard_model(GPT(CFG), fsdp_unit_modules=[Block], zero_dp_strategy=3)
    explained: dict[str, Any] = {}
    if compiled:
        block = model.module.blocks[0]
        eager_forward = block.forward

        def explain(_module: Any, args: tuple) -> None:
            if not explained:  # once, while fsdp has gathered the unit
                with torch.no_grad():
                    e = torch._dynamo.explain(eager_forward)(*args)
                explained.update(breaks=e.graph_break_count, graphs=e.graph_count)

        handle = block.register_forward_pre_hook(explain)
        for b in model.module.blocks:
            b.forward = torch.compile(b.forward, backend="aot_eager", fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = token_batch(step, 4, CFG.max_seq_len, CFG.vocab_size)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if compiled and step == 0:
            handle.remove()
    return losses, explained


def _body() -> dict[str, Any]:
    eager, _ = _train(False)
    compiled, explained = _train(True)
    return {"eager": eager, "compiled": compiled, **explained}


def test_compiled_units_no_graph_breaks_and_eager_parity() -> None:
    for rank, r in enumerate(run_distributed(_body, 2, timeout=240)):
        assert r["breaks"] == 0 and r["graphs"] == 1, (rank, r)
        for step, (a, b) in enumerate(zip(r["eager"], r["compiled"], strict=True)):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (rank, step, a, b)


# ---- unit.compile() ----------------------------------------------------------------------

UNIT_COMPILE_STRATEGIES = (3, 2)


def _train_unit_compile(strategy: int, compiled: bool) -> dict[str, Any]:
    """STEPS SGD steps; with ``compiled``, every unit compiled by ``unit.compile()`` with
    a backend that counts the graphs it is given. Returns the losses, this rank's shards
    of the final weights and, compiled, dynamo's graph breaks and the graph count."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = fully_shard_model(GPT(CFG), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    counter = CompileCounterWithBackend("aot_eager")
    if compiled:
        for block in model.module.blocks:
            block.compile(backend=counter)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = token_batch(step, 4, CFG.max_seq_len, CFG.vocab_size)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    shards = {
        name: shard.to_local().detach().clone()
        for name, shard in model.buffer.views.local_shard_dtensors().items()
    }
    return {
        "losses": losses,
        "shards": shards,
        # Every graph break dynamo took, by reason, those before an empty graph included
        # (``torch._dynamo.explain`` only reports breaks after a graph it compiled).
        "breaks": dict(counters["graph_break"]),
        "graphs": counter.frame_count,
        "units": len(model.module.blocks),
    }


def _unit_compile_body() -> dict[int, dict[str, Any]]:
    return {
        strategy: {
            "eager": _train_unit_compile(strategy, compiled=False),
            "compiled": _train_unit_compile(strategy, compiled=True),
        }
        for strategy in UNIT_COMPILE_STRATEGIES
    }


def test_unit_compile_no_graph_breaks_and_eager_parity() -> None:
    """``unit.compile()`` compiles the unit's ``_call_impl``, hooks included: fsdp's hooks
    run with dynamo skipping their frames, so no graph breaks anywhere, at most one graph
    per unit (only their forwards are traced; dynamo reuses one graph for equal blocks),
    and training matches the same model trained eagerly (fp32 within 1e-5)."""
    for rank, by_strategy in enumerate(run_distributed(_unit_compile_body, 2, timeout=400)):
        for strategy, r in by_strategy.items():
            eager, compiled = r["eager"], r["compiled"]
            where = f"rank {rank} ZeRO-{strategy}"
            assert compiled["breaks"] == {}, (where, list(compiled["breaks"]))
            assert 1 <= compiled["graphs"] <= compiled["units"], (where, compiled["graphs"])
            for step, (a, b) in enumerate(zip(eager["losses"], compiled["losses"], strict=True)):
                assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (where, step, a, b)
            assert_tensors_close(compiled["shards"], eager["shards"], where=where)
