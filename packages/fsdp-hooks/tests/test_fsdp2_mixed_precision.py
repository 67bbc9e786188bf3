"""FSDP2's mixed-precision spelling on the wrapper: ``param_dtype``, ``reduce_dtype``,
``output_dtype``, ``cast_forward_inputs``.

The library makes the compute copy in ``param_dtype``: an fp32 model wrapped with
``param_dtype=torch.bfloat16`` computes in bf16 (logits equal the unwrapped model cast
to bf16 exactly: the gathered compute weights are the same bf16 roundings and the
kernels the same), as does a model already in bf16; floating inputs are cast to
``param_dtype`` and outputs to ``output_dtype``. A frozen fp32 parameter (no main
weights to keep its precision in) is refused with the instruction. Gradients are
reduced in ``reduce_dtype``, and after ``reset_mixed_precision_policy`` in the new
policy's ``grad_comm_dtype`` (resolved when the policy is set). Training parity
and the fp32 main weights are in ``test_mixed_precision_policies``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_buffers import MixedPrecisionPolicy
from fsdp_hooks import fully_shard_model
from fsdp_mesh.testing import harness_device, run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

# Runs on CUDA + NCCL under --fsdp-device cuda (root conftest.py).
pytestmark = pytest.mark.cuda

CFG = GPTConfig(vocab_size=64, max_seq_len=8, dim=32, n_heads=4, n_layers=2)


class _FloatIn(nn.Module):
    """Records the dtype of a floating input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x.dtype
        return self.lin(x)


def _reduced_width(stats: dict[str, dict[str, float]]) -> float:
    """Bytes per element of the gradient reductions in ``comm_stats()``."""
    kinds = ("reduce_scatter", "all_reduce")
    return sum(stats[k]["bytes"] for k in kinds) / sum(stats[k]["numel"] for k in kinds)


def _body() -> dict[str, object]:
    out: dict[str, object] = {}
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
    )
    torch.manual_seed(0)
    frozen = GPT(CFG)
    frozen.tok.weight.requires_grad_(False)
    try:
        fully_shard_model(frozen, fsdp_unit_modules=[Block], mixed_precision_policy=policy)
    except ValueError as e:
        out["frozen_fp32"] = str(e)

    torch.manual_seed(0)
    # On the rank's device, as the wrapped models and x are: the same kernels.
    ref = GPT(CFG).to(device=harness_device(), dtype=torch.bfloat16)
    x, _ = token_batch(0, 2, CFG.max_seq_len, CFG.vocab_size)
    with torch.no_grad():
        want = ref(x)
    for name, cast in (("fp32_model", False), ("bf16_model", True)):
        torch.manual_seed(0)
        module = GPT(CFG).to(torch.bfloat16) if cast else GPT(CFG)
        model = fully_shard_model(module, fsdp_unit_modules=[Block], mixed_precision_policy=policy)
        with torch.no_grad():
            got = model(x)
        out[f"{name}_dtype"] = str(got.dtype)
        out[f"{name}_equal"] = torch.equal(got, want.float())

    mod = _FloatIn()
    wrapped = fully_shard_model(mod, mixed_precision_policy=policy)
    y = wrapped(torch.ones(2, 4, device=harness_device()))
    out["input_cast"] = str(wrapped.module.seen)
    out["output"] = str(y.dtype)
    wrapped.comm_stats(reset=True)
    wrapped(torch.ones(2, 4, device=harness_device())).sum().backward()
    out["reduced_bytes_per_element"] = _reduced_width(wrapped.comm_stats(reset=True))
    # Megatron-FSDP's reset takes the new communication dtype (from the next reduction
    # on); the compute dtype stays (the compute buffers are in it), so inputs are still
    # cast to it.
    wrapped.reset_mixed_precision_policy(MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16))
    wrapped.module.seen = None
    wrapped(torch.ones(2, 4, device=harness_device())).sum().backward()
    out["after_reset"] = (str(wrapped.mp_policy.param_dtype), str(wrapped.module.seen))
    out["reduced_bytes_per_element_after_reset"] = _reduced_width(wrapped.comm_stats())
    no_cast = fully_shard_model(
        _FloatIn().to(torch.bfloat16),
        mixed_precision_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, cast_forward_inputs=False
        ),
    )
    try:
        no_cast(torch.ones(2, 4, device=harness_device()))
    except RuntimeError:
        out["no_cast"] = "dtype error"  # bf16 weights, fp32 input: torch refuses
    return out


def test_fsdp2_mixed_precision_fields_on_the_wrapper() -> None:
    for rank, r in enumerate(run_distributed(_body, 2, timeout=120)):
        assert "cast them to torch.bfloat16 before wrapping" in str(r.get("frozen_fp32")), r
        for name in ("fp32_model", "bf16_model"):
            assert r[f"{name}_dtype"] == "torch.float32", (rank, r)
            assert r[f"{name}_equal"] is True, (rank, r)
        assert r["input_cast"] == "torch.bfloat16", (rank, r)
        assert r["output"] == "torch.float32", (rank, r)
        assert r["no_cast"] == "dtype error", (rank, r)
        assert r["after_reset"] == ("torch.bfloat16", "torch.bfloat16"), (rank, r)
        # reduce_dtype=fp32, then the reset's bf16: the reductions follow the policy.
        assert r["reduced_bytes_per_element"] == 4.0, (rank, r)
        assert r["reduced_bytes_per_element_after_reset"] == 2.0, (rank, r)
