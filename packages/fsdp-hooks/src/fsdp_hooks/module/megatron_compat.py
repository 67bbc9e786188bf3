"""What ``MegatronFSDP`` needs only to speak Megatron-FSDP's (and Megatron-Core's) API.

- ``default_ddp_config``: Megatron-FSDP's configuration when ``ddp_config`` is None
  (``optim_grads_params``, overlapped reduction and gather).
- ``reset_policy``: Megatron-FSDP's ``reset_mixed_precision_policy`` rule.
- ``MegatronParamAndGradBuffer``: ``model.param_and_grad_buffer`` as Megatron-FSDP's
  users and Megatron-Core's ``DistributedOptimizer`` read it.
- ``find_megatron_fsdp``: Megatron-FSDP's ``utils.find_megatron_fsdp``.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

from torch import nn

from fsdp_buffers import MixedPrecisionPolicy, ParamAndGradBuffer, ParameterGroup
from fsdp_hooks.module.config import DistributedDataParallelConfig

__all__ = [
    "MegatronParamAndGradBuffer",
    "default_ddp_config",
    "find_megatron_fsdp",
    "reset_policy",
]


def default_ddp_config(
    keep_fp8_transpose_cache: bool,
    nccl_ub: bool,
    fsdp_double_buffer: bool,
    disable_symmetric_registration: bool,
) -> DistributedDataParallelConfig:
    """Megatron-FSDP's ``ddp_config`` when none is given: ZeRO-3 (``optim_grads_params``)
    with overlapped gradient reduction and parameter gather, averaging outside the
    collective, no NaN check."""
    return DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params",
        outer_dp_sharding_strategy="no_shard",
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        average_in_collective=False,
        keep_fp8_transpose_cache=keep_fp8_transpose_cache,
        nccl_ub=nccl_ub,
        fsdp_double_buffer=fsdp_double_buffer or nccl_ub,
        disable_symmetric_registration=disable_symmetric_registration,
        check_for_nan_in_grad=False,
    )


def reset_policy(current: MixedPrecisionPolicy, new: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """Megatron-FSDP's rule: the main weight and main gradient dtypes stay (the buffers
    were allocated in them); the gradient communication dtype is the new policy's
    (``grad_comm_dtype`` or FSDP2's ``reduce_dtype``). FSDP2's ``param_dtype`` stays
    too (the compute buffers are in it); its forward casts are the new policy's."""
    if not isinstance(new, MixedPrecisionPolicy):
        raise TypeError(
            f"reset_mixed_precision_policy: expected a MixedPrecisionPolicy; got "
            f"{type(new).__name__}"
        )
    return MixedPrecisionPolicy(
        main_params_dtype=current.main_params_dtype,
        main_grads_dtype=current.main_grads_dtype,
        grad_comm_dtype=new.grad_comm_dtype
        if new.grad_comm_dtype is not None
        else new.reduce_dtype,
        param_dtype=current.param_dtype,
        output_dtype=new.output_dtype,
        cast_forward_inputs=new.cast_forward_inputs,
    )


class _Wrapper(Protocol):
    """The part of ``MegatronFSDP`` its buffer view reads (the wrapper imports this
    module, so it is named by what it offers)."""

    buffer: ParamAndGradBuffer
    mixed_precision_policy: MixedPrecisionPolicy

    def install_optimized_model_weights(self) -> None: ...


class MegatronParamAndGradBuffer:
    """``MegatronFSDP.param_and_grad_buffer``: fsdp's ``ParamAndGradBuffer`` with the
    names Megatron-FSDP's buffer has and Megatron-Core's ``DistributedOptimizer``
    calls (with ``ddp_config.use_megatron_fsdp``):

    - ``parameter_groups``: the buckets (``ParameterGroup``: ``params``,
      ``model_weight_buffer``, ``main_weight_buffer``, ``main_grad_buffer``, ...);
    - ``copy_main_weights_to_model_weights()``: install the stepped main weights in the
      compute weights (``MegatronFSDP.install_optimized_model_weights``, which also
      drops gathered copies that are stale after a step);
    - ``mp_policy``: the wrapper's mixed-precision policy.

    Any other attribute is the underlying buffer's (``model.buffer``)."""

    def __init__(self, wrapper: _Wrapper) -> None:
        object.__setattr__(self, "_wrapper", weakref.ref(wrapper))

    def _model(self) -> _Wrapper:
        wrapper = self._wrapper()
        if wrapper is None:
            raise RuntimeError("the MegatronFSDP model owning this buffer no longer exists")
        return wrapper

    @property
    def parameter_groups(self) -> list[ParameterGroup]:
        return self._model().buffer.groups

    @property
    def mp_policy(self) -> MixedPrecisionPolicy:
        return self._model().mixed_precision_policy

    def copy_main_weights_to_model_weights(self) -> None:
        self._model().install_optimized_model_weights()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model().buffer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"param_and_grad_buffer.{name} cannot be set here; set it on model.buffer "
            "(or use model.reset_mixed_precision_policy for the policy)"
        )

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MegatronParamAndGradBuffer):
            return self._model() is other._model()
        return NotImplemented

    def __hash__(self) -> int:
        return hash(id(self._model()))

    def __repr__(self) -> str:
        return f"MegatronParamAndGradBuffer({self._model().buffer!r})"


def find_megatron_fsdp(model: Any) -> nn.Module | None:
    """The first ``MegatronFSDP`` on the chain ``model``, ``model.module``,
    ``model.module.module``, ... (Megatron-Core's adapter keeps it as ``.module``), or
    None when there is none (Megatron-FSDP's ``utils.find_megatron_fsdp``)."""
    seen: set[int] = set()
    m = model
    while m is not None and id(m) not in seen:
        # The class's marker, not getattr(m): a wrapper resolving attributes of the
        # module it holds (Megatron-Core's adapter) would answer for it.
        if getattr(type(m), "_is_fsdp_wrapper", False):
            return m
        seen.add(id(m))
        m = getattr(m, "module", None)
    return None
