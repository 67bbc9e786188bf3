import dataclasses
import re

import pytest
import torch

from fsdp_buffers.mixed_precision import MixedPrecisionPolicy

# Runs on CUDA + NCCL under --fsdp-device cuda (root conftest.py).
pytestmark = pytest.mark.cuda

bf16, fp16, fp32, fp64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


def test_fields_names_order_and_defaults_are_megatron_fsdps():
    fields = [(f.name, f.default) for f in dataclasses.fields(MixedPrecisionPolicy)]
    assert fields[:3] == [
        ("main_params_dtype", fp32),
        ("main_grads_dtype", None),
        ("grad_comm_dtype", None),
    ]
    # Then FSDP2's fields, keyword only in practice, with FSDP2's defaults.
    assert fields[3:] == [
        ("param_dtype", None),
        ("reduce_dtype", None),
        ("output_dtype", None),
        ("cast_forward_inputs", True),
    ]
    # Positional construction in Megatron's order.
    policy = MixedPrecisionPolicy(fp32, bf16, fp16)
    assert (policy.main_params_dtype, policy.main_grads_dtype, policy.grad_comm_dtype) == (
        fp32,
        bf16,
        fp16,
    )


def test_is_frozen_and_hashable():
    policy = MixedPrecisionPolicy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.main_grads_dtype = bf16
    assert policy == MixedPrecisionPolicy()
    assert hash(policy) == hash(MixedPrecisionPolicy())
    assert dataclasses.replace(policy, grad_comm_dtype=bf16).grad_comm_dtype == bf16


# (param dtype) -> (main params, main grads, grad comm) under the default policy.
DEFAULT_TABLE = {
    bf16: (fp32, fp32, fp32),
    fp16: (fp32, fp32, fp32),
    fp32: (fp32, fp32, fp32),
    fp64: (fp64, fp64, fp64),
}


def _resolve(policy, param_dtype):
    return (
        policy.main_params_dtype_for(param_dtype),
        policy.main_grads_dtype_for(param_dtype),
        policy.grad_comm_dtype_for(param_dtype),
    )


@pytest.mark.parametrize(("param_dtype", "expected"), list(DEFAULT_TABLE.items()))
def test_default_resolution_accumulates_narrow_floats_in_fp32(param_dtype, expected):
    assert _resolve(MixedPrecisionPolicy(), param_dtype) == expected


@pytest.mark.parametrize(
    ("policy", "param_dtype", "expected"),
    [
        # main_params_dtype=None: main weights stay in the parameter dtype.
        (MixedPrecisionPolicy(main_params_dtype=None), bf16, (bf16, fp32, fp32)),
        (MixedPrecisionPolicy(main_params_dtype=None), fp64, (fp64, fp64, fp64)),
        # Explicit main-grad dtype wins over the rule (Megatron-FSDP's bf16 accumulation).
        (MixedPrecisionPolicy(main_grads_dtype=bf16), bf16, (fp32, bf16, bf16)),
        (MixedPrecisionPolicy(main_grads_dtype=bf16), fp32, (fp32, bf16, bf16)),
        (MixedPrecisionPolicy(main_grads_dtype=fp64), fp16, (fp32, fp64, fp64)),
        # Communication dtype overrides only the communication.
        (MixedPrecisionPolicy(grad_comm_dtype=bf16), bf16, (fp32, fp32, bf16)),
        (MixedPrecisionPolicy(grad_comm_dtype=fp32), fp64, (fp64, fp64, fp32)),
        (MixedPrecisionPolicy(fp64, fp32, fp16), bf16, (fp64, fp32, fp16)),
        # fp8 parameters are narrower than 32 bits: fp32 accumulation.
        (MixedPrecisionPolicy(), torch.float8_e4m3fn, (fp32, fp32, fp32)),
    ],
)
def test_explicit_overrides(policy, param_dtype, expected):
    assert _resolve(policy, param_dtype) == expected


def test_the_reason_for_the_rule_bf16_accumulation_drops_small_gradients():
    # 512 microbatches of the same gradient: a bf16 running sum stalls at 256
    # (256 + 1 rounds back to 256), an fp32 one is exact.
    grad = torch.ones(1, dtype=bf16)
    acc_bf16 = torch.zeros(1, dtype=bf16)
    acc_rule = torch.zeros(1, dtype=MixedPrecisionPolicy().main_grads_dtype_for(bf16))
    for _ in range(512):
        acc_bf16 += grad
        acc_rule += grad
    assert acc_bf16.item() == 256.0
    assert acc_rule.item() == 512.0


@pytest.mark.parametrize("field", ["main_params_dtype", "main_grads_dtype", "grad_comm_dtype"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
def test_non_float_policy_dtypes_are_rejected(field, dtype):
    with pytest.raises(
        ValueError, match=re.escape(f"{field} must be a floating-point dtype, got {dtype}")
    ):
        MixedPrecisionPolicy(**{field: dtype})


@pytest.mark.parametrize("field", ["main_params_dtype", "main_grads_dtype"])
def test_fp8_main_weights_or_grads_are_rejected(field):
    with pytest.raises(ValueError, match=re.escape(f"{field}=torch.float8_e4m3fn is too narrow")):
        MixedPrecisionPolicy(**{field: torch.float8_e4m3fn})


def test_fp8_communication_is_allowed():
    assert MixedPrecisionPolicy(grad_comm_dtype=torch.float8_e5m2).grad_comm_dtype_for(bf16) == (
        torch.float8_e5m2
    )


@pytest.mark.parametrize("field", ["main_params_dtype", "main_grads_dtype", "grad_comm_dtype"])
def test_non_dtype_values_are_a_type_error(field):
    with pytest.raises(
        TypeError, match=re.escape(f"{field} must be a torch.dtype or None, got 'bf16'")
    ):
        MixedPrecisionPolicy(**{field: "bf16"})


@pytest.mark.parametrize(
    "method", ["main_params_dtype_for", "main_grads_dtype_for", "grad_comm_dtype_for"]
)
@pytest.mark.parametrize("policy", [MixedPrecisionPolicy(), MixedPrecisionPolicy(None, bf16, bf16)])
def test_non_float_parameters_are_not_handled(method, policy):
    with pytest.raises(
        ValueError, match=re.escape("floating-point parameters only, got torch.int64")
    ):
        getattr(policy, method)(torch.int64)
    with pytest.raises(TypeError, match=re.escape("Expected a parameter's torch.dtype")):
        getattr(policy, method)("float32")


def test_fsdp2_spelling_is_accepted():
    """Before: TypeError (unexpected keyword). reduce_dtype is grad_comm_dtype."""
    policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    assert policy.param_dtype == bf16
    assert policy.grad_comm_dtype_for(bf16) == fp32
    assert policy.main_params_dtype_for(bf16) == fp32  # main weights stay fp32
    assert MixedPrecisionPolicy(reduce_dtype=bf16).grad_comm_dtype_for(fp32) == bf16
    same = MixedPrecisionPolicy(grad_comm_dtype=bf16, reduce_dtype=bf16)
    assert same.grad_comm_dtype_for(fp32) == bf16


def test_fsdp2_spelling_bad_input():
    with pytest.raises(ValueError, match=r"reduce_dtype=torch\.bfloat16.*grad_comm_dtype"):
        MixedPrecisionPolicy(reduce_dtype=bf16, grad_comm_dtype=fp16)
    with pytest.raises(TypeError, match="cast_forward_inputs must be a bool"):
        MixedPrecisionPolicy(cast_forward_inputs="yes")
    with pytest.raises(ValueError, match="output_dtype must be a floating-point"):
        MixedPrecisionPolicy(output_dtype=torch.int32)
    with pytest.raises(TypeError, match=r"param_dtype must be a torch\.dtype"):
        MixedPrecisionPolicy(param_dtype="bf16")
