"""``fsdp-plan``: the table and the JSON are ``plan()``'s figures."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fsdp_mesh.testing.models import GPT, Block
from fsdp_plan import plan
from fsdp_plan.cli import main


def test_cli_prints_and_writes_the_plans(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(
        [
            "fsdp_mesh.testing.models:GPT",
            "--world-size",
            "4",
            "--strategy",
            "3,optim",
            "--units",
            "Block",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "optim_grads_params" in table and "optim" in table and "reduce_scatter" in table
    written = json.loads(out.read_text())
    assert [p["strategy"] for p in written] == ["optim_grads_params", "optim"]
    for entry, strategy in zip(written, (3, 1), strict=True):
        with torch.device("meta"):
            module = GPT()
        expected = plan(module, 4, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
        assert entry["per_rank"] == expected.per_rank
        assert entry["comm"] == json.loads(json.dumps(expected.comm))


def test_cli_refuses_a_bad_model_spec():
    with pytest.raises(SystemExit, match=r"module\.path:factory"):
        main(["fsdp_mesh.testing.models.GPT", "--world-size", "2"])
    with pytest.raises(SystemExit, match="Nope"):
        main(["fsdp_mesh.testing.models:GPT", "--world-size", "2", "--units", "Nope"])


def test_memory_per_device_sweep(tmp_path, capsys):
    from fsdp_plan.sweep import parse_bytes

    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("8e3") == 8000
    with pytest.raises(ValueError, match="cannot read"):
        parse_bytes("lots")
    # A budget between the smallest and the largest peak of the candidates.
    with torch.device("meta"):
        module = GPT()
    zero3 = plan(module, 4, fsdp_unit_modules=[Block], zero_dp_strategy=3).per_rank["peak"]
    out = tmp_path / "sweep.json"
    argv = ["fsdp_mesh.testing.models:GPT", "--world-size", "4", "--units", "Block"]
    assert main([*argv, "--memory-per-device", str(zero3), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    found = json.loads(out.read_text())
    # dp_outer 1, 2, 4: 4 strategies each, plus fully-sharded HSDP for 2 and 4.
    assert len(found) == 14
    for entry in found:
        assert entry["fits"] == (entry["per_rank"]["peak"] <= zero3)
    fits = [e for e in found if e["fits"]]
    assert fits and len(fits) < len(found)
    assert found[: len(fits)] == fits  # those that fit come first ...
    moved = [
        sum(e["per_rank"][k] for k in ("all_gather", "reduce_scatter", "all_reduce")) for e in fits
    ]
    assert moved == sorted(moved)  # ... by bytes moved per step
    assert "cheapest that does not fit" in text and "largest part" in text
    # With a tp dim (or experts) only dp_outer 1: the wrapper has no hybrid tp yet.
    assert main([*argv, "--tp", "2", "--memory-per-device", "1GiB", "--json", str(out)]) == 0
    found = json.loads(out.read_text())
    assert [(e["dp_outer"], e["options"]["tp"]) for e in found] == [(1, "2")] * 4


def test_hugging_face_config(tmp_path, capsys):
    transformers = pytest.importorskip("transformers", reason="needs transformers (hf group)")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        dtype="bfloat16",
    )
    config.save_pretrained(tmp_path)
    out = tmp_path / "plan.json"
    argv = [str(tmp_path / "config.json"), "--world-size", "4", "--json", str(out)]
    assert main(argv) == 0
    (written,) = json.loads(out.read_text())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    expected = plan(model, 4, fsdp_unit_modules=[LlamaDecoderLayer], zero_dp_strategy=3)
    assert written["per_rank"] == expected.per_rank
    # bf16 compute weights, fp32 main weights: the config's dtype was used.
    assert written["per_rank"]["main_weights"] == 2 * written["per_rank"]["parameters"]


def test_hugging_face_config_with_tp(tmp_path):
    """``--tp 2``: the model split by its tensor-parallel plan (colwise rows, rowwise
    columns, the vocabulary), one tp rank's pieces marked for fsdp; the rest whole."""
    transformers = pytest.importorskip("transformers", reason="needs transformers (hf group)")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from fsdp_plan.hf import tp_local

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=101,
    )
    config.save_pretrained(tmp_path)
    out = tmp_path / "plan.json"
    argv = [str(tmp_path / "config.json"), "--world-size", "4", "--tp", "2", "--json", str(out)]
    assert main(argv) == 0
    (written,) = json.loads(out.read_text())
    with torch.device("meta"):
        whole = transformers.AutoModelForCausalLM.from_config(config)
    local = tp_local(copy.deepcopy(whole), 2)
    shapes = {n: tuple(p.shape) for n, p in local.named_parameters()}
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 64)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (16, 64)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (64, 48)
    assert shapes["model.embed_tokens.weight"] == (51, 64)  # torch.chunk: rank 0's 51
    assert shapes["lm_head.weight"] == (51, 64)
    assert shapes["model.norm.weight"] == (64,)
    marked = {n for n, p in local.named_parameters() if getattr(p, "tensor_model_parallel", 0)}
    assert "model.layers.0.input_layernorm.weight" not in marked and len(marked) == 2 + 2 * 7
    expected = plan(local, 4, tp=2, fsdp_unit_modules=[LlamaDecoderLayer], zero_dp_strategy=3)
    assert written["per_rank"] == expected.per_rank
    # Half the model per tp rank (the norms whole), sharded over the 2 data-parallel ranks.
    numel = sum(p.numel() for p in local.parameters())
    assert numel < 0.52 * sum(p.numel() for p in whole.parameters())
    assert written["per_rank"]["parameters"] == pytest.approx(4 * numel / 2, rel=0.02)


def test_cli_activations(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["fsdp_mesh.testing.models:GPT", "--world-size", "2", "--units", "Block"]
    assert main([*argv, "--batch-size", "2", "--seq-len", "8", "--json", str(out)]) == 0
    assert "activations" in capsys.readouterr().out
    (written,) = json.loads(out.read_text())
    with torch.device("meta"):
        module = GPT()
    expected = plan(module, 2, fsdp_unit_modules=[Block], batch_size=2, seq_len=8)
    assert written["per_rank"] == expected.per_rank and expected.per_rank["activations"] > 0
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        main([*argv, "--batch-size", "2"])


def test_cli_plans_muon(tmp_path):
    out = tmp_path / "plan.json"
    args = ["fsdp_mesh.testing.models:GPT", "--world-size", "4", "--units", "Block"]
    assert main([*args, "--optimizer", "muon", "--json", str(out)]) == 0
    (entry,) = json.loads(out.read_text())
    with torch.device("meta"):
        module = GPT()
    expected = plan(module, 4, optimizer="muon", fsdp_unit_modules=[Block])
    adamw = plan(module, 4, fsdp_unit_modules=[Block])
    assert entry["options"]["optimizer"] == "muon"
    assert entry["per_rank"] == expected.per_rank
    assert entry["comm"] == json.loads(json.dumps(expected.comm))
    # Whole placement pads the shards: the plan moves more than AdamW's row pieces.
    assert expected.comm["all_gather"]["padding_bytes"] > adamw.comm["all_gather"]["padding_bytes"]
