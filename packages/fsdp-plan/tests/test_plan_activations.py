"""``plan(..., batch_size, seq_len)``'s ``activations`` (a meta-device forward, tensors
saved for backward) against ``memory_stats()["activations"]`` measured on the real
wrapped forward under ``model.measure_activations()`` (CPU: the same saved-tensor
accounting), within 10%, for our GPT and a tiny Hugging Face Llama, at world size 2
under ZeRO-3 and ZeRO-1, fp32 and bf16, at several batch shapes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_hooks import fully_shard
from fsdp_mesh.testing import run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch
from fsdp_plan import MODEL_STATE_KEYS, plan

CFG = GPTConfig(vocab_size=66, dim=36, n_heads=4, n_layers=3, max_seq_len=64)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (strategy, dtype, batch, seq)
CONFIGS = [(3, "fp32", 2, 8), (3, "fp32", 4, 64), (1, "bf16", 2, 32)]


def _llama_config():
    import transformers

    return transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )


def _build(kind: str):
    if kind == "gpt":
        return GPT(CFG), [Block], CFG.vocab_size
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return transformers.AutoModelForCausalLM.from_config(_llama_config()), [LlamaDecoderLayer], 100


def _logits(output):
    return output if isinstance(output, torch.Tensor) else output.logits


def _measure(kind, configs):
    out = []
    for strategy, dtype, batch, seq in configs:
        torch.manual_seed(0)
        module, units, vocab = _build(kind)
        module = module.to(DTYPES[dtype])
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        model, optimizer = fully_shard(
            module, optimizer, fsdp_unit_modules=units, zero_dp_strategy=strategy
        )
        unmeasured = model.memory_stats()
        for step in range(2):
            x, y = token_batch(step, batch, seq, vocab, seed=dist.get_rank())
            with model.measure_activations():
                logits = _logits(model(x))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        out.append(((strategy, dtype, batch, seq), unmeasured, model.memory_stats()))
    return out


def _check(kind, configs):
    measured = run_distributed(_measure, 2, args=(kind, configs), timeout=120)
    for config in configs:
        strategy, dtype, batch, seq = config
        with torch.device("meta"):
            meta, units, _ = _build(kind)
            meta = meta.to(DTYPES[dtype])
        p = plan(
            meta,
            2,
            fsdp_unit_modules=units,
            zero_dp_strategy=strategy,
            batch_size=batch,
            seq_len=seq,
        )
        planned = p.per_rank["activations"]
        for rank, results in enumerate(measured):
            ((before, got),) = [(u, m) for c, u, m in results if c == config]
            assert "activations" not in before  # measured only when asked
            where = f"{kind} {config} rank {rank}: planned {planned}, measured {got}"
            assert got["activations"] > 0, where
            assert abs(planned - got["activations"]) <= 0.10 * got["activations"], where
            assert got["total"] == sum(v for k, v in got.items() if k != "total")
        assert p.per_rank["peak"] == sum(
            p.per_rank[k] for k in (*MODEL_STATE_KEYS, "gathered_peak", "activations")
        )


def test_gpt_activations_match_the_measurement():
    _check("gpt", CONFIGS)


def test_hugging_face_llama_activations_match_the_measurement():
    pytest.importorskip("transformers", reason="needs transformers (the hf dependency group)")
    _check("llama", [(3, "fp32", 2, 16), (3, "bf16", 2, 32)])


def test_activations_grow_with_the_batch_and_are_not_the_math_attention():
    """Linear in the batch, with no part for the parameters (only the position ids do
    not grow with it); and attention counted as a fused kernel saves it: linear in the
    sequence, never the math path's batch x heads x seq x seq probabilities."""
    with torch.device("meta"):
        meta = GPT(CFG)

    def acts(batch, seq):
        p = plan(meta, 4, fsdp_unit_modules=[Block], batch_size=batch, seq_len=seq)
        return p.per_rank["activations"]

    a = acts(2, 16)
    positions = 16 * 8  # int64 ids saved by the position embedding, one row
    assert acts(4, 16) == 2 * (a - positions) + positions
    assert acts(6, 16) == 3 * (a - positions) + positions
    assert acts(2, 64) == 4 * a
    a = plan(meta, 4, fsdp_unit_modules=[Block], batch_size=2, seq_len=16)
    # Model state does not depend on the inputs; without inputs, no activations key.
    bare = plan(meta, 4, fsdp_unit_modules=[Block])
    assert "activations" not in bare.per_rank
    assert bare.per_rank["peak"] + a.per_rank["activations"] == a.per_rank["peak"]


def test_example_inputs_and_bad_inputs():
    with torch.device("meta"):
        meta = GPT(CFG)
    ids = torch.zeros(2, 16, dtype=torch.long)  # a real tensor: only its shape is used
    by_tensor = plan(meta, 2, example_inputs=ids).per_rank["activations"]
    by_tuple = plan(meta, 2, example_inputs=(ids,)).per_rank["activations"]
    by_shape = plan(meta, 2, batch_size=2, seq_len=16).per_rank["activations"]
    assert by_tensor == by_tuple == by_shape
    assert by_tensor == plan(meta, 2, example_inputs={"idx": ids}).per_rank["activations"]
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        plan(meta, 2, batch_size=2)
    with pytest.raises(ValueError, match="not both"):
        plan(meta, 2, batch_size=2, seq_len=4, example_inputs=ids)
    with pytest.raises(TypeError, match="example_inputs must be"):
        plan(meta, 2, example_inputs="tokens")
    with pytest.raises(RuntimeError, match="meta-device forward"):
        plan(meta, 2, example_inputs=torch.zeros(2, 16))  # float ids: embedding refuses


def _losses(modes):
    out = []
    for mode in modes:
        torch.manual_seed(0)
        module = GPT(CFG)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
        model, optimizer = fully_shard(
            module,
            optimizer,
            fsdp_unit_modules=[Block],
            zero_dp_strategy=3,
            regather_saved_weights=mode == "measured+regather",
        )
        losses = []
        for step in range(3):
            x, y = token_batch(step, 2, 16, CFG.vocab_size, seed=dist.get_rank())
            if mode == "plain":
                logits = model(x)
            else:
                with model.measure_activations():
                    logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        out.append((mode, losses, model.memory_stats().get("activations")))
    return out


def test_measuring_changes_nothing_and_composes_with_regathered_weights():
    """Measured steps train exactly as unmeasured ones (same losses over three steps,
    so the same gradients), and inside the wrapper's own saved-weight hooks
    (regather_saved_weights=True) the count is the same: both hooks run."""
    modes = ("plain", "measured", "measured+regather")
    for results in run_distributed(_losses, 2, args=(modes,), timeout=120):
        by_mode = {m: (losses, acts) for m, losses, acts in results}
        assert by_mode["plain"][1] is None
        assert by_mode["measured"][0] == by_mode["plain"][0]
        assert by_mode["measured+regather"][0] == by_mode["plain"][0]
        assert by_mode["measured"][1] > 0
        assert by_mode["measured+regather"][1] == by_mode["measured"][1]
