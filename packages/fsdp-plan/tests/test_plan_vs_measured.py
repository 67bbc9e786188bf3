"""``fsdp.plan`` against the real thing: every model-state key of the plan equals
``model.memory_stats()`` of the wrapped model after two training steps (and its
``checkpoint_staging`` the host bytes an asynchronous save stages), and the plan's
collectives per step equal ``model.comm_stats()`` of the second step (calls, elements,
bytes, ring traffic), within 1%, at world sizes 1, 2 and 4, under every strategy, in
fp32 and with a bf16 model (fp32 main weights and gradients in separate buffers), with
AdamW, SGD with momentum and plain SGD; and under two mixed-precision policies whose
extra buffers the plan must count: bf16 gradients of fp32 weights (the optimizer's
gradients are a copy cast to fp32) and FSDP2's ``param_dtype=torch.bfloat16`` on an fp32
model (a bf16 compute copy beside the fp32 main weights).

One ``run_distributed`` call per world size wraps and steps every configuration; the
plans are made in this process, on a meta-device GPT, over a fake process group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_buffers import MixedPrecisionPolicy
from fsdp_ckpt import HostStager
from fsdp_hooks import fully_shard
from fsdp_mesh.testing import run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch
from fsdp_plan import MODEL_STATE_KEYS, plan

STRATEGIES = (0, 1, 2, 3)
# (strategy, model dtype, optimizer)
CONFIGS = [(s, "fp32", "adamw") for s in STRATEGIES] + [
    (1, "bf16", "adamw"),
    (3, "bf16", "adamw"),
    (2, "fp32", "sgd_momentum"),
    (3, "bf16", "sgd"),
    (3, "fp32", "adamw", "bf16_grads"),
    (1, "fp32", "adamw", "bf16_grads"),
    (2, "fp32", "adamw", "bf16_params"),
]
POLICIES = {
    None: None,
    "bf16_grads": MixedPrecisionPolicy(torch.float32, torch.bfloat16),
    "bf16_params": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
}
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3),
}
# Rows that do not divide by 4 (vocab 66, 3*36 qkv rows...): padding and uneven
# torch.chunk pieces show up in both the plan and the measurement.
CFG = GPTConfig(vocab_size=66, dim=36, n_heads=4, n_layers=3)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _one_step(configs):
    results = []
    for config in configs:
        strategy, dtype, optim, policy = (*config, None)[:4]
        torch.manual_seed(0)
        module = GPT(CFG).to(DTYPES[dtype])
        optimizer = OPTIMIZERS[optim](module.parameters())
        model, optimizer = fully_shard(
            module,
            optimizer,
            fsdp_unit_modules=[Block],
            zero_dp_strategy=strategy,
            mixed_precision_policy=POLICIES[policy],
        )
        # Two steps; the second is counted: the first forward after wrapping also
        # re-installs the weights that optimizer-state initialisation touched.
        for step in range(2):
            model.reset_comm_stats()
            x, y = token_batch(step, 2, 8, CFG.vocab_size, seed=dist.get_rank())
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        comm = model.comm_stats()
        stats = dict(model.memory_stats())
        # What an asynchronous save stages: the host buffers of this rank's state.
        stager = HostStager()
        stager.stage({"model": model.state_dict(), "optim": optimizer.state_dict()})
        stats["checkpoint_staging"] = stager.nbytes
        results.append((config, stats, comm))
    return results


def _close(planned: float, measured: float) -> bool:
    return abs(planned - measured) <= 0.01 * max(abs(measured), 1)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_plan_matches_memory_stats_and_comm_stats(world_size):
    measured = run_distributed(_one_step, world_size, args=(CONFIGS,), timeout=120)
    for config in CONFIGS:
        strategy, dtype, optim, policy = (*config, None)[:4]
        with torch.device("meta"):
            meta = GPT(CFG).to(DTYPES[dtype])
        p = plan(
            meta,
            world_size,
            optimizer=optim,
            fsdp_unit_modules=[Block],
            zero_dp_strategy=strategy,
            mixed_precision_policy=POLICIES[policy],
        )
        figures = [p.per_rank, *p.ranks.values()]
        for rank, results in enumerate(measured):
            (got,) = [m for c, m, _ in results if c == config]
            (comm,) = [x for c, _, x in results if c == config]
            where = f"world {world_size}, {config}, rank {rank}"
            # This rank's planned figures: the one whose optimizer state matches
            # (ranks differ only there); every rank must match one of them.
            mine = [f for f in figures if _close(f["optimizer_state"], got["optimizer_state"])]
            assert mine, f"{where}: no planned rank has optimizer_state {got}; plan {figures}"
            for key in (*MODEL_STATE_KEYS, "checkpoint_staging"):
                assert _close(mine[0][key], got[key]), (where, key, mine[0][key], got[key])
            for kind, counts in comm.items():
                if kind == "broadcast":
                    continue
                for field, value in counts.items():
                    assert _close(p.comm[kind][field], value), (
                        where, kind, field, p.comm[kind][field], value
                    )  # fmt: skip
                if kind in mine[0]:
                    assert _close(mine[0][kind], counts["traffic_bytes"]), (where, kind)
        assert p.per_rank["peak"] == sum(
            p.per_rank[k] for k in (*MODEL_STATE_KEYS, "gathered_peak")
        )


# Hybrid sharding on a 2 x 2 mesh (dp_outer, dp_shard): HSDP under every inner strategy
# and fully-sharded HSDP, fp32 and bf16 (fp32 main weights then in their own fine buffer).
HYBRID = [(s, "no_shard", "fp32") for s in STRATEGIES] + [
    (3, "optim", "fp32"),
    (3, "optim", "bf16"),
    (1, "no_shard", "bf16"),
]


def _hybrid_step(configs):
    from fsdp_mesh import build_device_mesh

    results = []
    for strategy, outer, dtype in configs:
        torch.manual_seed(0)
        module = GPT(CFG).to(DTYPES[dtype])
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        meshes = build_device_mesh(dp_outer=2, dp_shard=2)
        model, optimizer = fully_shard(
            module,
            optimizer,
            **meshes.fsdp_kwargs(),
            fsdp_unit_modules=[Block],
            zero_dp_strategy=strategy,
            outer_dp_sharding_strategy=outer,
        )
        for step in range(2):
            model.reset_comm_stats()
            x, y = token_batch(step, 2, 8, CFG.vocab_size, seed=dist.get_rank())
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append(((strategy, outer, dtype), model.memory_stats(), model.comm_stats()))
    return results


def test_hybrid_plan_matches_memory_stats_and_comm_stats():
    measured = run_distributed(_hybrid_step, 4, args=(HYBRID,), timeout=120)
    for config in HYBRID:
        strategy, outer, dtype = config
        with torch.device("meta"):
            meta = GPT(CFG).to(DTYPES[dtype])
        p = plan(
            meta,
            4,
            dp_outer=2,
            fsdp_unit_modules=[Block],
            zero_dp_strategy=strategy,
            outer_dp_sharding_strategy=outer,
        )
        figures = {0: p.per_rank, **p.ranks}
        for rank, results in enumerate(measured):
            ((got, comm),) = [(m, c) for cfg, m, c in results if cfg == config]
            where = f"hybrid {config}, rank {rank}"
            mine = [
                f for f in figures.values() if _close(f["optimizer_state"], got["optimizer_state"])
            ]
            assert mine, f"{where}: no planned rank has optimizer_state {got}; plan {figures}"
            for key in MODEL_STATE_KEYS:
                assert _close(mine[0][key], got[key]), (where, key, mine[0][key], got[key])
            for kind, counts in comm.items():
                if kind == "broadcast":
                    continue
                for field, value in counts.items():
                    assert _close(p.comm[kind][field], value), (
                        where, kind, field, p.comm[kind][field], value
                    )  # fmt: skip
        # The outer dim carries only the replicas' reductions and the fully-sharded
        # weight sync; the rest is the shard group's.
        outer_dim = p.comm_by_dim["dp_outer"]
        if outer == "optim":
            assert (
                outer_dim["reduce_scatter"]["calls"] > 0 and outer_dim["all_reduce"]["calls"] == 0
            )
        else:
            assert (
                outer_dim["all_reduce"]["calls"] > 0 and outer_dim["reduce_scatter"]["calls"] == 0
            )
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            parts = sum(p.comm_by_dim[d][kind]["bytes"] for d in ("dp_shard", "dp_outer"))
            assert parts == p.comm[kind]["bytes"]


# A tiny Hugging Face Llama (decoder layers as units, untied head) at 1, 2 and 4 ranks,
# every strategy and a bf16 model; and our GPT with its first block kept replicated
# (fsdp_no_shard).
HF = [(s, "fp32") for s in STRATEGIES] + [(3, "bf16")]


def _llama():
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=40,
        intermediate_size=60,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=66,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


def _hf_step(configs):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    results = []
    for strategy, dtype in configs:
        torch.manual_seed(0)
        module = _llama().to(DTYPES[dtype])
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        model, optimizer = fully_shard(
            module, optimizer, fsdp_unit_modules=[LlamaDecoderLayer], zero_dp_strategy=strategy
        )
        for step in range(2):
            model.reset_comm_stats()
            x, y = token_batch(step, 2, 8, 66, seed=dist.get_rank())
            logits = model(x).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append(((strategy, dtype), model.memory_stats(), model.comm_stats()))
    return results


def _compare(p, got, comm, where):
    figures = [p.per_rank, *p.ranks.values()]
    mine = [f for f in figures if _close(f["optimizer_state"], got["optimizer_state"])]
    assert mine, f"{where}: no planned rank has optimizer_state {got}; plan {figures}"
    for key in MODEL_STATE_KEYS:
        assert _close(mine[0][key], got[key]), (where, key, mine[0][key], got[key])
    for kind, counts in comm.items():
        if kind == "broadcast":
            continue
        for field, value in counts.items():
            assert _close(p.comm[kind][field], value), (
                where, kind, field, p.comm[kind][field], value
            )  # fmt: skip


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_hugging_face_llama_plan_matches_memory_stats_and_comm_stats(world_size):
    pytest.importorskip("transformers", reason="needs transformers (the hf dependency group)")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    measured = run_distributed(_hf_step, world_size, args=(HF,), timeout=120)
    for config in HF:
        strategy, dtype = config
        with torch.device("meta"):
            meta = _llama().to(DTYPES[dtype])
        p = plan(meta, world_size, fsdp_unit_modules=[LlamaDecoderLayer], zero_dp_strategy=strategy)
        for rank, results in enumerate(measured):
            ((got, comm),) = [(m, c) for cfg, m, c in results if cfg == config]
            _compare(p, got, comm, f"llama world {world_size} {config} rank {rank}")


def _no_shard_step(strategies):
    from fsdp_buffers import fsdp_no_shard

    results = []
    for strategy in strategies:
        torch.manual_seed(0)
        module = GPT(CFG)
        fsdp_no_shard(module.blocks[0])
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        model, optimizer = fully_shard(
            module, optimizer, fsdp_unit_modules=[Block], zero_dp_strategy=strategy
        )
        for step in range(2):
            model.reset_comm_stats()
            x, y = token_batch(step, 2, 8, CFG.vocab_size, seed=dist.get_rank())
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append((strategy, model.memory_stats(), model.comm_stats()))
    return results


def test_fsdp_no_shard_marks_are_planned():
    """A block marked ``fsdp_no_shard`` on the module given to plan() stays replicated
    in the plan as in the job (plan()'s meta copy keeps the mark)."""
    from fsdp_buffers import fsdp_no_shard

    strategies = (1, 3)
    measured = run_distributed(_no_shard_step, 2, args=(strategies,), timeout=120)
    for strategy in strategies:
        with torch.device("meta"):
            meta = GPT(CFG)
        fsdp_no_shard(meta.blocks[0])
        p = plan(meta, 2, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
        for rank, results in enumerate(measured):
            ((got, comm),) = [(m, c) for s, m, c in results if s == strategy]
            _compare(p, got, comm, f"no_shard strategy {strategy} rank {rank}")
