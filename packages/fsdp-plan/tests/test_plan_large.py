"""A plan at world size 1,024 for a Llama-70B-shaped model on the meta device: in
seconds, without allocating its weights; and what plan() refuses."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fsdp_buffers import MixedPrecisionPolicy
from fsdp_mesh.testing.models import GPT, Block
from fsdp_plan import plan

HERE = Path(__file__).parent

_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, time
    sys.path.insert(0, {here!r})
    import torch
    from llama_shapes import DecoderLayer, LlamaShaped
    from fsdp_plan import plan

    def rss():  # current resident bytes
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    with torch.device("meta"):
        model = LlamaShaped().to(torch.bfloat16)
    before_max = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    before = rss()
    start = time.perf_counter()
    p = plan(model, 1024, fsdp_unit_modules=[DecoderLayer], zero_dp_strategy=3)
    seconds = time.perf_counter() - start
    grown = max(rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) - max(
        before, before_max
    )
    params = sum(t.numel() for t in model.parameters())
    still_meta = all(t.device.type == "meta" for t in model.parameters())
    print(json.dumps(dict(seconds=seconds, grown=grown, params=params, still_meta=still_meta,
                          per_rank=p.per_rank)))
    """
)


def test_llama_70b_at_1024_ranks_in_seconds_without_weights():
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(here=str(HERE))],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["seconds"] < 30, result
    assert result["grown"] < 2**30, result
    assert result["still_meta"]
    params = result["params"]
    assert 70e9 < params < 71e9
    per_rank = result["per_rank"]
    # bf16 compute shards, fp32 main weights and grads: each about params/1024 elements
    # (the vocabulary, 128,256 rows, is the only uneven split: 125.25 rows per rank).
    assert per_rank["parameters"] == pytest.approx(2 * params / 1024, rel=1e-3)
    assert per_rank["main_weights"] == pytest.approx(4 * params / 1024, rel=1e-3)
    assert per_rank["main_grads"] == pytest.approx(4 * params / 1024, rel=1e-3)
    assert per_rank["optimizer_state"] == pytest.approx(8 * params / 1024, rel=1e-2)


def test_plan_leaves_the_module_alone():
    module = GPT()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    plan(module, 8, fsdp_unit_modules=[Block])
    after = dict(module.named_parameters())
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert after[name].device.type == "cpu"
        torch.testing.assert_close(after[name].detach(), value, rtol=0, atol=0)
    assert module.head.weight is module.tok.weight


@pytest.mark.parametrize(
    ("option", "value", "named"),
    [
        ("dp_outer_dim", "dp_outer", "dp_outer=<size>"),
        ("tp_dim", "tp", "tp=<size>"),
        ("expt_device_mesh", object(), "ep=<size>"),
    ],
)
def test_options_it_cannot_model_are_refused_by_name(option, value, named):
    with torch.device("meta"):
        module = GPT()
    with pytest.raises(NotImplementedError, match=named):
        plan(module, 8, **{option: value})


def test_bad_input_is_refused():
    with torch.device("meta"):
        module = GPT()
    with pytest.raises(TypeError, match="unexpected option 'zero_strategy'"):
        plan(module, 8, zero_strategy=3)
    with pytest.raises(ValueError, match="optimizer='lion'"):
        plan(module, 8, optimizer="lion")
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        plan(module, 0)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        plan(module, 8, batch_size=0, seq_len=16)
    # What the wrapper refuses, plan() refuses: fully-sharded HSDP below ZeRO-3, frozen
    # parameters in another dtype than param_dtype (no main weights to keep them in).
    with pytest.raises(ValueError, match="requires"):
        plan(module, 8, dp_outer=2, zero_dp_strategy=2, outer_dp_sharding_strategy="optim")
    module.tok.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="param_dtype"):
        plan(
            module,
            8,
            mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        )
