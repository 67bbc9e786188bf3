"""Hugging Face models: ``fsdp.from_pretrained`` and meta-device init with the model's
own initializer.

Tiny configs are written by ``save_pretrained`` in the test itself (no downloads) and
loaded at world size 2 into ZeRO-3 models; the reference is transformers' own
``from_pretrained`` of the same directory in each rank. Logits must be equal (the same
weights and the same fp32 kernels: exact). Mixtral and Qwen3-MoE are saved by transformers
5 with per-expert tensors that ``from_pretrained`` fuses into 3-D ones, and checkpoint
names differ from the module names, so a load that skipped transformers' conversions
would fail (unexpected keys) rather than pass.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from fsdp_mesh.testing import run_distributed

transformers = pytest.importorskip(
    "transformers", minversion="5", reason="needs transformers>=5 (dependency group hf)"
)
safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")

WORLD = 2
SEED = 0


def _make(arch: str) -> tuple[type, Any]:
    T = transformers
    # Shapes divisible by the world size: shards are torch.chunk pieces.
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    common.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    if arch == "llama":
        return T.LlamaForCausalLM, T.LlamaConfig(**common, tie_word_embeddings=False)
    if arch == "llama_tied":
        return T.LlamaForCausalLM, T.LlamaConfig(**common, tie_word_embeddings=True)
    if arch == "llama_big":  # ~23 MB in fp32, largest tensor (embedding) 4 MiB
        big = dict(common, vocab_size=4096, hidden_size=256, intermediate_size=512)
        big.update(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
        return T.LlamaForCausalLM, T.LlamaConfig(**big, tie_word_embeddings=False)
    if arch == "mixtral":
        return T.MixtralForCausalLM, T.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2
        )
    if arch == "qwen3moe":
        return T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig(
            **common,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            head_dim=8,
            decoder_sparse_step=1,
        )
    if arch == "vit":
        return T.ViTForImageClassification, T.ViTConfig(
            image_size=8,
            patch_size=4,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            num_labels=4,
        )
    if arch == "t5":
        return T.T5ForConditionalGeneration, T.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4
        )
    raise AssertionError(arch)


def _inputs(arch: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if arch == "vit":
        return {"pixel_values": torch.randn(2, 3, 8, 8, generator=g)}
    ids = torch.randint(0, 64, (2, 8), generator=g)
    if arch == "t5":
        return {"input_ids": ids, "decoder_input_ids": ids.flip(1)}
    return {"input_ids": ids}


def _save(arch: str, directory: Path, **kwargs: Any) -> Path:
    cls, cfg = _make(arch)
    torch.manual_seed(SEED)
    model = cls(cfg)
    dtype = kwargs.pop("dtype", None)
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(directory, **kwargs)
    return directory


# ---- on the ranks ------------------------------------------------------------------------


def _logits_match(cases: list[tuple[str, str]]) -> dict[str, float]:
    import fsdp

    out: dict[str, float] = {}
    for arch, directory in cases:
        cls, _ = _make(arch)
        model = fsdp.from_pretrained(cls, directory, zero_dp_strategy=3)
        assert isinstance(model, fsdp.MegatronFSDP)
        ref = cls.from_pretrained(directory, dtype=torch.float32)
        with torch.no_grad():
            got = model(**_inputs(arch)).logits
            want = ref(**_inputs(arch)).logits
        out[f"{arch}:{directory}"] = (got - want).abs().max().item()
    return out


def _bf16_compute(directory: str) -> dict[str, Any]:
    """fp32 checkpoint, FSDP2's ``param_dtype=bf16``: the main weights are the checkpoint's
    fp32 values (not their bf16 rounding), and the logits are those of transformers'
    model loaded in bf16 (the same rounding of the same weights)."""
    import fsdp

    cls, _ = _make("llama")
    policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = fsdp.from_pretrained(cls, directory, zero_dp_strategy=3, mixed_precision_policy=policy)
    ref32 = cls.from_pretrained(directory, dtype=torch.float32)
    ref16 = cls.from_pretrained(directory, dtype=torch.bfloat16)
    full = model.buffer.views.full_parameters()
    want = dict(ref32.named_parameters())
    with torch.no_grad():
        got = model(**_inputs("llama")).logits
        expect = ref16(**_inputs("llama")).logits
    return {
        "main_fp32_exact": all(
            full[n].dtype == torch.float32 and torch.equal(full[n], want[n]) for n in full
        ),
        "covered": set(full) == set(want),
        "logits_dtype": str(got.dtype),
        "logits_diff": (got.float() - expect.float()).abs().max().item(),
    }


def _generate(directory: str) -> dict[str, Any]:
    import fsdp

    cls, _ = _make("llama")
    model = fsdp.from_pretrained(cls, directory, zero_dp_strategy=3)
    ref = cls.from_pretrained(directory, dtype=torch.float32)
    ids = _inputs("llama")["input_ids"]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = model.generate(ids, **kw)
    want = ref.generate(ids, **kw)
    # The model is usable afterwards: a training forward and backward.
    model.train()
    model(input_ids=ids).logits.sum().backward()
    return {
        "equal": torch.equal(got, want),
        "new": got.shape[1] - ids.shape[1],
        "distributed": all(isinstance(p, DTensor) for p in model.module.parameters()),
    }


def _round_trip(arch: str, directory: str, out: str) -> dict[str, Any]:
    """Load, train one step, save_pretrained (sharded: small max_shard_size); the saved
    directory loads with transformers' from_pretrained to the trained model's logits."""
    import torch.distributed as dist

    import fsdp

    cls, _ = _make(arch)
    model = fsdp.from_pretrained(cls, directory)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(**_inputs(arch)).logits.square().mean().backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        trained = model(**_inputs(arch)).logits
    model.save_pretrained(out, max_shard_size="8KB")
    dist.barrier()
    back = cls.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        again = back(**_inputs(arch)).logits
    first = cls.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        before = first(**_inputs(arch)).logits
    return {
        "equal": torch.equal(again, trained),
        "changed": not torch.equal(before, trained),
        "index": (Path(out) / "model.safetensors.index.json").is_file(),
    }


def _train_and_checkpoint(arch: str, directory: str, ckpt: str) -> torch.Tensor:
    import fsdp

    cls, _ = _make(arch)
    model = fsdp.from_pretrained(cls, directory)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(**_inputs(arch)).logits.square().mean().backward()
    opt.step()
    fsdp.save_checkpoint(ckpt, model, opt)
    model.eval()
    with torch.no_grad():
        return model(**_inputs(arch)).logits


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _load_memory(directory: str) -> dict[str, int]:
    """Peak RSS growth (VmHWM, reset through /proc/self/clear_refs) while the checkpoint
    is loaded into the wrapped model, after a first load has paid for lazy imports and
    transformers' conversion tables; glibc is told to map every large block on its own,
    so a freed tensor leaves RSS (as test_meta_init's memory test does)."""
    import ctypes

    from fsdp_hooks import fully_shard_model
    from fsdp_hooks.integrations.huggingface import (
        _build_on_meta,
        _default_units,
        load_pretrained_weights,
    )

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    cls, _ = _make("llama_big")
    model = _build_on_meta(cls, Path(directory), torch.float32)
    wrapper = fully_shard_model(
        model, init_model_with_meta_device=True, fsdp_unit_modules=_default_units(model)
    )
    load_pretrained_weights(wrapper, directory)  # warm-up
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _rss_kib("VmRSS")
    load_pretrained_weights(wrapper, directory)
    growth = (_rss_kib("VmHWM") - before) * 1024
    sizes = [p.numel() * 4 for p in model.parameters()]
    return {"growth": growth, "largest": max(sizes), "full": sum(sizes)}


def _errors_of(arch: str, directories: list[str]) -> list[str]:
    import fsdp

    cls, _ = _make(arch)
    out = []
    for directory in directories:
        try:
            fsdp.from_pretrained(cls, directory)
        except (ValueError, FileNotFoundError) as e:
            out.append(f"{type(e).__name__}: {e}")
        else:
            out.append("no error")
    return out


def _meta_init(arch: str) -> dict[str, Any]:
    """A Hugging Face model built on meta and wrapped with meta-device init: the
    deterministic tensors (norms, biases, rotary inv_freq) equal the eager model's, the
    random ones follow the model's initializer (normal, std initializer_range)."""
    import fsdp
    from fsdp_ckpt import get_full_model_state_dict

    cls, cfg = _make(arch)
    torch.manual_seed(SEED)
    eager = cls(cfg)
    with torch.device("meta"):
        meta = cls(cfg)
    torch.manual_seed(SEED)
    model = fsdp.fully_shard_model(
        meta, init_model_with_meta_device=True, fsdp_unit_modules=[type(eager.model.layers[0])]
    )
    full = get_full_model_state_dict(model.module, rank0_only=False)
    want = eager.state_dict()
    out: dict[str, Any] = {"differ": [], "stds": {}}
    for name, value in full.items():
        ref = want[name]
        if name.endswith("norm.weight") or name.endswith(".bias"):
            if not torch.equal(value, ref):
                out["differ"].append(name)
        else:
            out["stds"][name] = value.std().item()
    eager_buffers = dict(eager.named_buffers())
    for name, b in model.module.named_buffers():
        if not torch.equal(b, eager_buffers[name]):
            out["differ"].append(name)
    return out


# ---- tests -------------------------------------------------------------------------------


def test_logits_equal_transformers(tmp_path: Path) -> None:
    """Llama (tied and untied), Mixtral and Qwen3-MoE (per-expert checkpoint tensors fused
    by transformers' converters), ViT and T5; one bf16 checkpoint sharded over several
    files with an index: ZeRO-3 logits equal transformers' from_pretrained."""
    cases = [
        (arch, str(_save(arch, tmp_path / arch)))
        for arch in ("llama", "llama_tied", "mixtral", "qwen3moe", "vit", "t5")
    ]
    sharded = _save("llama", tmp_path / "sharded_bf16", dtype=torch.bfloat16, max_shard_size="8KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    cases.append(("llama", str(sharded)))
    with safetensors_torch.safe_open(tmp_path / "mixtral" / "model.safetensors", "pt") as f:
        assert any(".experts.0." in k for k in f.keys())  # noqa: SIM118 per-expert on disk: converted

    results = run_distributed(_logits_match, WORLD, args=(cases,), timeout=240)
    for rank, diffs in enumerate(results):
        assert diffs and all(d == 0.0 for d in diffs.values()), (rank, diffs)


def test_from_pretrained_with_bf16_compute(tmp_path: Path) -> None:
    directory = str(_save("llama", tmp_path / "llama"))
    for rank, r in enumerate(run_distributed(_bf16_compute, WORLD, args=(directory,))):
        assert r["main_fp32_exact"] and r["covered"], (rank, r)
        assert r["logits_dtype"] == "torch.bfloat16", (rank, r)
        assert r["logits_diff"] == 0.0, (rank, r)


def test_generate_under_zero3(tmp_path: Path) -> None:
    """Before: ``model.module.generate`` failed ("mixed torch.Tensor and DTensor"). Now
    ``model.generate`` gathers as forward does and gives transformers' tokens."""
    directory = str(_save("llama", tmp_path / "llama"))
    for rank, r in enumerate(run_distributed(_generate, WORLD, args=(directory,), timeout=120)):
        assert r == {"equal": True, "new": 6, "distributed": True}, (rank, r)


@pytest.mark.parametrize("arch", ["llama_tied", "mixtral"])
def test_save_pretrained_round_trip(arch: str, tmp_path: Path) -> None:
    """Out again: a trained ZeRO-3 model written by model.save_pretrained (consolidated,
    transformers' on-disk names: Mixtral's experts unfused again, sharded with an index)
    loads with transformers' from_pretrained to the same logits."""
    directory = str(_save(arch, tmp_path / "in"))
    out = str(tmp_path / "out")
    results = run_distributed(_round_trip, WORLD, args=(arch, directory, out), timeout=180)
    for rank, r in enumerate(results):
        assert r == {"equal": True, "changed": True, "index": True}, (rank, r)


def test_consolidate_hf(tmp_path: Path) -> None:
    """``fsdp-consolidate --hf``: a checkpoint of a trained ZeRO-3 Mixtral (3-D fused
    experts in memory) becomes a save_pretrained directory (per-expert on-disk names,
    sharded with an index) that transformers' from_pretrained loads to the same logits."""
    from fsdp_ckpt.cli import main

    directory = str(_save("mixtral", tmp_path / "in"))
    ckpt, out = str(tmp_path / "ckpt"), tmp_path / "out"
    trained = run_distributed(
        _train_and_checkpoint, WORLD, args=("mixtral", directory, ckpt), timeout=180
    )[0]
    assert main([ckpt, str(out), "--hf", directory, "--max-shard-size", "8KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert any(".experts.0." in k for k in index["weight_map"])
    cls, _ = _make("mixtral")
    back = cls.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        # Another process (its own thread count, so reduction order): fp32 within 1e-5.
        torch.testing.assert_close(back(**_inputs("mixtral")).logits, trained, atol=1e-5, rtol=1e-5)


def test_load_peak_memory(tmp_path: Path) -> None:
    """Loading holds this rank's shards plus about one tensor: peak RSS grows by at most
    1.5x the largest tensor while loading (measured: 0.97x on rank 0, 0.53x on rank 1;
    the whole model is 4.3x the largest tensor; the shards exist before). RSS, not the torch allocator: safetensors maps the file, and
    the profiler counts that file-backed mapping as an allocation of the whole file."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to reset the peak RSS")
    directory = str(_save("llama_big", tmp_path / "big"))
    for rank, r in enumerate(run_distributed(_load_memory, WORLD, args=(directory,))):
        assert r["full"] > 4 * r["largest"], r  # the bound is about one tensor, not all
        assert r["growth"] <= 1.5 * r["largest"], (rank, r)


def test_bad_checkpoints_name_the_entry(tmp_path: Path) -> None:
    """An unmappable key, a missing parameter and a shape mismatch are errors naming them,
    on every rank; never a silently wrong weight."""
    base = _save("llama", tmp_path / "base")
    weights = safetensors_torch.load_file(base / "model.safetensors")

    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "config.json").write_text((base / "config.json").read_text())
    safetensors_torch.save_file(
        {**weights, "model.layers.0.mystery.weight": torch.ones(4)}, extra / "model.safetensors"
    )

    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text((base / "config.json").read_text())
    safetensors_torch.save_file(
        {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"},
        missing / "model.safetensors",
    )

    shape = tmp_path / "shape"
    shape.mkdir()
    config = json.loads((base / "config.json").read_text())
    config["intermediate_size"] = 32
    (shape / "config.json").write_text(json.dumps(config))
    safetensors_torch.save_file(weights, shape / "model.safetensors")

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((base / "config.json").read_text())

    cases = {
        extra: "model.layers.0.mystery.weight",
        missing: "model.layers.1.mlp.up_proj.weight",
        shape: "'model.layers.0.mlp.down_proj.weight' has shape (32, 64)",
        empty: "model.safetensors",
    }
    results = run_distributed(
        _errors_of, WORLD, args=("llama", [str(d) for d in cases]), timeout=120
    )
    for rank, messages in enumerate(results):
        for (directory, expected), message in zip(cases.items(), messages, strict=True):
            assert expected in message, (directory.name, rank, message)


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_meta_init_uses_model_initializer(arch: str) -> None:
    """Before: refused (RMSNorm, rotary inv_freq, routers and fused experts have no
    reset_parameters). Now the model's _init_weights fills them."""
    results = run_distributed(_meta_init, WORLD, args=(arch,), timeout=120)
    _, cfg = _make(arch)
    for rank, r in enumerate(results):
        assert r["differ"] == [], (rank, r["differ"])
        assert r["stds"], rank
        for name, std in r["stds"].items():
            # normal(0, initializer_range) over >= 128 elements: within 40%
            assert abs(std - cfg.initializer_range) < 0.4 * cfg.initializer_range, (name, std)


def test_load_checkpoint_of_a_save_pretrained_dir_points_to_from_pretrained(
    tmp_path: Path,
) -> None:
    """Before: "an interrupted save". Now the message names fsdp.from_pretrained."""
    import fsdp

    directory = _save("llama", tmp_path / "hf")
    with pytest.raises(fsdp.IncompleteCheckpointError, match=r"fsdp\.from_pretrained"):
        fsdp.load_checkpoint(directory, torch.nn.Linear(2, 2))
