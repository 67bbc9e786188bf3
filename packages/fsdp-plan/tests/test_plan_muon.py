"""``plan(optimizer="muon")`` against a real wrapped Muon run: ``fully_shard(model,
[Muon(matrices), AdamW(rest)])`` places the matrices Muon steps whole on one owner rank
each (Note [whole placement] in ``fsdp_buffers.layout``), so shards grow to their
most-loaded rank's and the collectives move padding. The plan's collectives per step
(calls, elements, bytes, ring traffic and ``padding_bytes``) equal ``model.comm_stats()``
of the second step, and every rank's model-state bytes (``optimizer_state``: Muon's one
momentum buffer on the owner, AdamW's two plus ``step`` for the rest) equal
``model.memory_stats()``, and its ``gathered_peak`` the gathered bytes held at once
(``GatheredMeter`` of ``test_plan_gathered_peak``), so its ``peak`` is the rank's
measured model state plus gathered weights, at world 2 and 4, ZeRO-1/2/3, with and
without unit coalescing (``suggested_communication_unit_size``), fp32 and bf16, and
under HSDP (2 x 2, world 4), for Muon over every matrix and over the hidden
matrices only (embeddings to AdamW, through ``muon_params``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fsdp_buffers import collectives
from fsdp_hooks import fully_shard
from fsdp_mesh import build_device_mesh
from fsdp_mesh.testing import run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch
from fsdp_plan import MODEL_STATE_KEYS, plan

pytestmark = pytest.mark.skipif(
    not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9"
)

# Rows that do not divide by 4 (vocab 66, 108 qkv rows): uneven pieces and owners.
CFG = GPTConfig(vocab_size=66, dim=36, n_heads=4, n_layers=3)
COALESCE = 10**6  # every unit in one bucket (0: one bucket per unit)
# (strategy, suggested_communication_unit_size, which matrices Muon steps, dp_outer)
CONFIGS = [
    (3, 0, "hidden", 1),
    (3, COALESCE, "hidden", 1),
    (1, 0, "hidden", 1),
    (2, COALESCE, "hidden", 1),
    (3, 0, "all", 1),
    (1, COALESCE, "all", 1),
    # HSDP (world 4 only): 2 replicas of 2-rank shard groups, owners per shard group.
    (3, 0, "hidden", 2),
    (1, COALESCE, "hidden", 2),
    # A bf16 model: fp32 main weights, gradients and state in their own buffers.
    (3, 0, "hidden", 1, torch.bfloat16),
    (1, COALESCE, "all", 1, torch.bfloat16),
]


def is_hidden(name: str, p: torch.Tensor) -> bool:
    """Muon's usual split: the blocks' matrices; embeddings, norms and biases to AdamW."""
    return p.ndim == 2 and name.startswith("blocks.")


def _muon_and_adamw(module, which: str) -> list[torch.optim.Optimizer]:
    named = list(module.named_parameters())
    muon = [p for n, p in named if p.ndim == 2 and (which == "all" or is_hidden(n, p))]
    rest = [p for n, p in named if all(p is not q for q in muon)]
    return [torch.optim.Muon(muon, lr=1e-2), torch.optim.AdamW(rest, lr=1e-3)]


def _one_step(configs):
    # The spawned ranks import this file's neighbour too.
    sys.path.insert(0, str(Path(__file__).parent))
    from test_plan_gathered_peak import GatheredMeter

    results = []
    original = collectives.all_gather
    for config in configs:
        strategy, unit_size, which, dp_outer, dtype = (*config, torch.float32)[:5]
        torch.manual_seed(0)
        module = GPT(CFG).to(dtype)
        mesh = {}
        if dp_outer > 1:
            mesh = build_device_mesh(dp_outer=dp_outer, dp_shard=4 // dp_outer).fsdp_kwargs()
        model, optimizers = fully_shard(
            module,
            _muon_and_adamw(module, which),
            **mesh,
            fsdp_unit_modules=[Block],
            zero_dp_strategy=strategy,
            suggested_communication_unit_size=unit_size,
        )
        # Two steps; the second is counted (the first forward after wrapping also
        # re-installs the weights that optimizer-state initialisation touched).
        meter = GatheredMeter(model.buffer)
        collectives.all_gather = meter.observe(original)
        try:
            for step in range(2):
                model.reset_comm_stats()
                meter.peak = 0
                x, y = token_batch(step, 2, 8, CFG.vocab_size, seed=dist.get_rank())
                logits = model(x)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                loss.backward()
                for opt in optimizers:
                    opt.step()
                    opt.zero_grad()
        finally:
            collectives.all_gather = original
        params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
        whole = sum(hasattr(p, "_fsdp_whole_owner") for p in params)
        stats = model.memory_stats()
        # Both optimizers' state (memory_stats() alone reads the one attached last).
        stats["optimizer_state"] = sum(
            model.memory_stats(opt)["optimizer_state"] for opt in optimizers
        )
        stats["gathered_peak"] = meter.peak
        results.append((config, stats, model.comm_stats(), whole))
    return results


def _plan(world_size: int, config, optimizer: str = "muon"):
    strategy, unit_size, which, dp_outer, dtype = (*config, torch.float32)[:5]
    with torch.device("meta"):
        meta = GPT(CFG).to(dtype)
    return plan(
        meta,
        world_size,
        dp_outer=dp_outer,
        optimizer=optimizer,
        muon_params=is_hidden if which == "hidden" and optimizer == "muon" else None,
        fsdp_unit_modules=[Block],
        zero_dp_strategy=strategy,
        suggested_communication_unit_size=unit_size,
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_muon_plan_equals_comm_stats_and_memory_stats(world_size):
    configs = [c for c in CONFIGS if c[3] == 1 or world_size == 4]
    measured = run_distributed(_one_step, world_size, args=(configs,), timeout=180)
    padding = {}
    for config in configs:
        p = _plan(world_size, config)
        figures = [p.per_rank, *p.ranks.values()]
        states = set()
        for rank, results in enumerate(measured):
            (got, comm, whole) = next(r[1:] for r in results if r[0] == config)
            where = f"world {world_size}, {config}, rank {rank}"
            assert whole > 0, f"{where}: nothing was placed whole"
            assert got["gathered_peak"] > 0, where
            for kind, counts in comm.items():
                if kind == "broadcast":
                    continue
                for field, value in counts.items():
                    assert p.comm[kind][field] == pytest.approx(value, abs=1e-6), (
                        where, kind, field, p.comm[kind][field], value
                    )  # fmt: skip
                if kind in p.per_rank:
                    assert p.per_rank[kind] == round(counts["traffic_bytes"]), (where, kind)
            # Ranks differ in their optimizer state (owners): this rank's planned figures
            # are the ones whose state is its state, exactly.
            mine = [f for f in figures if f["optimizer_state"] == got["optimizer_state"]]
            assert mine, f"{where}: no planned rank has {got}; plan {figures}"
            for key in (*MODEL_STATE_KEYS, "gathered_peak"):
                assert mine[0][key] == got[key], (where, key, mine[0][key], got[key])
            # So the planned peak is this rank's model state plus its gathered peak.
            assert mine[0]["peak"] == sum(got[k] for k in (*MODEL_STATE_KEYS, "gathered_peak"))
            states.add(got["optimizer_state"])
        # Every distinct planned rank shows up in the run (none is invented).
        assert {f["optimizer_state"] for f in figures} == states, (world_size, config)
        assert p.per_rank["peak"] == sum(
            p.per_rank[k] for k in (*MODEL_STATE_KEYS, "gathered_peak")
        )
        padding[config] = sum(c["padding_bytes"] for c in p.comm.values())
        # Whole placement's padding: at least the same job's with AdamW alone (row
        # pieces); more with one unit per bucket (a few matrices cannot balance).
        adamw = _plan(world_size, config, optimizer="adamw")
        rows = sum(c["padding_bytes"] for c in adamw.comm.values())
        assert padding[config] >= rows, config
        if config[1] == 0:
            assert padding[config] > rows, config
        assert p.per_rank["optimizer_state"] < adamw.per_rank["optimizer_state"] * 2, config
    # Coalescing balances owners over every unit's matrices: less padding (ZeRO-3, hidden).
    assert padding[(3, COALESCE, "hidden", 1)] < padding[(3, 0, "hidden", 1)], padding


def test_muon_params_needs_muon_and_a_callable():
    with torch.device("meta"):
        meta = GPT(CFG)
    with pytest.raises(ValueError, match="muon_params is for optimizer='muon'"):
        plan(meta, 2, optimizer="adamw", muon_params=is_hidden)
    with pytest.raises(TypeError, match="muon_params must be a callable"):
        plan(meta, 2, optimizer="muon", muon_params="blocks")
