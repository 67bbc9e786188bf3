"""``DistributedDataParallel``: Megatron-Core's DDP wrapper, on fsdp's buffers.

Gradients live in contiguous, bucketed buffers (a ``ParamAndGradBuffer`` with strategy
``no_shard``, or ``optim`` with ``use_distributed_optimizer``), and each bucket is
all-reduced, or reduce-scattered, as soon as backward has produced all its gradients
(``overlap_grad_reduce``), or all at once in ``finish_grad_sync`` (without it).

Note on the optimizer contract (Megatron-Core's, made explicit):

- The module's parameters stay ordinary, whole, replicated tensors (their storage is a
  view into the weight buffer). Backward leaves ``param.grad`` None: each gradient is
  moved into ``param.main_grad``, a view into the gradient buffer, in the gradient dtype
  (fp32 with ``accumulate_allreduce_grads_in_fp32``, else the parameters' dtype).
- After ``finish_grad_sync()`` (``finalize_model_grads([model])`` calls it):

  * all-reduce (``use_distributed_optimizer=False``): every ``param.main_grad`` holds
    the gradient averaged over the data-parallel group (summed with
    ``config.calculate_per_token_loss``). A Megatron-Core optimizer reads ``main_grad``.
    A torch optimizer reads ``.grad``: call ``model.copy_main_grads_to_grads()`` (or
    copy them yourself) before ``optimizer.step()``.
  * distributed optimizer (``use_distributed_optimizer=True``): gradients are
    reduce-scattered. Only this rank's shard of each ``main_grad`` (whole rows; the
    rest is zero) holds the reduced gradient, and only this rank steps that shard.
    ``model.distributed_optimizer_params()`` are that shard of the main weights (fp32
    for narrower parameters) as DTensor parameters whose ``.grad`` is the reduced
    gradient shard: step them with any torch optimizer, then call
    ``model.start_param_sync()``, which copies the shard into the parameters and
    all-gathers the whole model on every rank.
- ``zero_grad_buffer()`` before (or after) every step: gradients accumulate until then,
  across backwards and across ``no_sync``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_buffers import (
    GradReducePipeline,
    GradState,
    MixedPrecisionPolicy,
    ParamAndGradBuffer,
    ShardingStrategy,
)
from fsdp_hooks.adapters._common import dist_index_over, transformer_option
from fsdp_hooks.adapters.ddp_checks import WHO, effective_ddp_config
from fsdp_hooks.adapters.ddp_grads import DDPGradHooks
from fsdp_hooks.validation import check_not_wrapped, check_same_model

__all__ = ["DistributedDataParallel"]


def _policy(module: nn.Module, grads_in_fp32: bool, distributed: bool) -> MixedPrecisionPolicy:
    """Gradients in fp32, or in the parameters' dtype; fp32 main weights only for the
    distributed optimizer's shard (without it the optimizer owns its main weights)."""
    dtypes = {p.dtype for p in module.parameters() if p.dtype.is_floating_point}
    grads = torch.float32 if grads_in_fp32 else (dtypes.pop() if len(dtypes) == 1 else None)
    return MixedPrecisionPolicy(
        main_params_dtype=torch.float32 if distributed else None, main_grads_dtype=grads
    )


def _module_device(module: nn.Module, mesh_device_type: str) -> torch.device:
    devices = {p.device for p in module.parameters()}
    if any(d.type == "meta" for d in devices):
        raise ValueError(
            f"{WHO}: the module has parameters on the meta device; materialize it first "
            "(meta-device initialization is a FullyShardedDataParallel feature)"
        )
    if not devices:
        raise ValueError(f"{WHO}: the module has no parameters; there is nothing to reduce")
    device = next(iter(devices))
    if device.type != mesh_device_type:
        raise ValueError(
            f"{WHO}: the module is on {device} but the data-parallel group's backend "
            f"({dist.get_backend()}) works on {mesh_device_type}; move the module to "
            f"{mesh_device_type} first"
        )
    return device


class DistributedDataParallel(nn.Module):
    """Megatron-Core's ``DistributedDataParallel(config, ddp_config, module, ...)``.

    Args:
        config: a transformer config (any object, or None); ``calculate_per_token_loss``
            is read (sum gradients instead of averaging them over ranks).
        ddp_config: ``DistributedDataParallelConfig`` (fsdp's or Megatron-Core's), a
            dict of its fields, or None. Read: ``grad_reduce_in_fp32``,
            ``overlap_grad_reduce``, ``use_distributed_optimizer``,
            ``check_for_nan_in_grad``, ``bucket_size``, ``average_in_collective``.
        module: the model, on this rank's device, the same on every rank.
        data_parallel_group: this rank's group to reduce gradients over (default: the
            world); it may be part of the world, beside tensor or pipeline groups.
        accumulate_allreduce_grads_in_fp32, overlap_grad_reduce,
        use_distributed_optimizer, check_for_nan_in_grad: override the ``ddp_config``
            fields of the same meaning when given (the older Megatron-Core signature).
        disable_bucketing: one bucket per dtype (as without ``overlap_grad_reduce``).

    See the module note for what the optimizer reads and when.
    """

    def __init__(
        self,
        config: object,
        ddp_config: object = None,
        module: nn.Module | None = None,
        data_parallel_group: dist.ProcessGroup | None = None,
        accumulate_allreduce_grads_in_fp32: bool | None = None,
        overlap_grad_reduce: bool | None = None,
        use_distributed_optimizer: bool | None = None,
        disable_bucketing: bool = False,
        check_for_nan_in_grad: bool | None = None,
    ) -> None:
        super().__init__()
        cfg = effective_ddp_config(
            ddp_config,
            accumulate_allreduce_grads_in_fp32=accumulate_allreduce_grads_in_fp32,
            overlap_grad_reduce=overlap_grad_reduce,
            use_distributed_optimizer=use_distributed_optimizer,
            check_for_nan_in_grad=check_for_nan_in_grad,
        )
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"{WHO}: module must be an nn.Module (the third argument, or module=...); "
                f"got {type(module).__name__}"
            )
        check_not_wrapped(module)
        per_token = bool(transformer_option(config, "calculate_per_token_loss"))
        dist_index = dist_index_over(data_parallel_group, WHO)
        device = _module_device(module, dist_index.device_type)
        # Megatron-Core's DDP leaves initial values as they are until broadcast_params().
        check_same_model(module, dist_index, check_values=False)
        self.config = config
        self.ddp_config = cfg
        self.module = module
        self.dist_index = dist_index
        self.data_parallel_group = dist_index.get_dp_group()
        self.strategy = ShardingStrategy.parse(cfg.data_parallel_sharding_strategy)
        self.buffer = ParamAndGradBuffer(
            module,
            dist_index,
            strategy=self.strategy,
            mixed_precision_policy=_policy(
                module, cfg.grad_reduce_in_fp32, cfg.use_distributed_optimizer
            ),
            bucket_size=cfg.bucket_size,
            disable_bucketing=disable_bucketing or not cfg.overlap_grad_reduce,
            device=device,
            gradient_scaling_factor=1.0 if per_token else None,
            average_in_collective=cfg.average_in_collective,
        )
        self.grad_reduce_pipeline = GradReducePipeline(self.buffer)
        self._hooks = DDPGradHooks(
            self.buffer,
            self.grad_reduce_pipeline,
            overlap_grad_reduce=cfg.overlap_grad_reduce,
            check_for_nan_in_grad=cfg.check_for_nan_in_grad,
        )

    # ---- forward ------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    # ---- gradients ----------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside only accumulate into ``main_grad``; the next backward
        outside (or ``finish_grad_sync``) reduces the sum."""
        previous, self._hooks.sync_enabled = self._hooks.sync_enabled, False
        try:
            yield
        finally:
            self._hooks.sync_enabled = previous

    def start_grad_sync(self, *unused: Any) -> None:
        """Reduce every bucket that holds unreduced gradients (on gloo and on one
        stream this completes before returning)."""
        self.grad_reduce_pipeline.reduce_accumulated()

    def finish_grad_sync(self) -> None:
        """Reduce whatever is still unreduced, wait for every reduction, and raise on
        every rank if ``check_for_nan_in_grad`` found NaN/Inf in a local gradient."""
        self.grad_reduce_pipeline.reduce_accumulated()
        self._hooks.raise_if_nonfinite(self.data_parallel_group)
        self.buffer.attach_grads()

    def scale_gradients(self, scaling_factor: float) -> None:
        self.buffer.scale_gradients(scaling_factor)

    def zero_grad_buffer(self, zero_buffer: bool = True) -> None:
        """Start a new accumulation: forget what was reduced, drop ``param.grad`` and
        reset ``grad_added_to_main_grad``. With ``zero_buffer=False`` the gradient
        memory is left as it is: the caller (e.g. an optimizer that owns views of it)
        zeroes it."""
        if zero_buffer:
            self.buffer.zero_grad_buffer()
        else:
            for gid, group in enumerate(self.buffer.groups):
                self.buffer.grad_state[gid] = GradState.EMPTY
                for p in group.params:
                    p.grad = None
        for group in self.buffer.groups:
            for p in group.params:
                p.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        self._hooks.clear_nonfinite()

    def copy_main_grads_to_grads(self) -> None:
        """``param.grad = copy of param.main_grad`` (in the parameter's dtype) for every
        trainable parameter, so that a torch optimizer steps on the reduced gradients.
        Meant for the all-reduce setting; under the distributed optimizer only this
        rank's shard of ``main_grad`` is meaningful."""
        with torch.no_grad():
            for group in self.buffer.groups:
                if not group.requires_grad:
                    continue
                for p in group.params:
                    p.grad = p.main_grad.to(p.dtype, copy=True)  # type: ignore[attr-defined]

    # ---- distributed optimizer ---------------------------------------------------------
    def distributed_optimizer_params(self) -> list[nn.Parameter]:
        """This rank's shard of the main weights, as DTensor parameters whose ``.grad``
        is the reduced gradient shard: what a torch optimizer steps when
        ``use_distributed_optimizer``. Follow each step with ``start_param_sync()``."""
        if not self.ddp_config.use_distributed_optimizer:
            raise RuntimeError(
                f"{WHO}: distributed_optimizer_params() needs use_distributed_optimizer=True; "
                "with all-reduce, step the module's parameters after "
                "copy_main_grads_to_grads() (or read param.main_grad)"
            )
        params = [p for _name, p in self.buffer.optimizer_named_parameters()]
        for p in params:
            if p.grad is not None and p.grad.dtype != p.dtype:
                raise ValueError(
                    f"{WHO}: the main weights are {p.dtype} but gradients accumulate in "
                    f"{p.grad.dtype}; a torch optimizer needs both in one dtype: pass "
                    "accumulate_allreduce_grads_in_fp32=True (ddp_config.grad_reduce_in_fp32)"
                )
        return params

    def start_param_sync(self, *unused: Any, force_sync: bool = False) -> None:
        """Distributed optimizer: copy this rank's stepped shard into the parameters and
        all-gather them, so every rank holds the whole updated model. No-op otherwise."""
        self.buffer.install_optimized_model_weights()

    def broadcast_params(self) -> None:
        """Make every rank's parameters equal to data-parallel rank 0's."""
        self.buffer.broadcast_params()

    # ---- state dicts ---------------------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict, under its own names (no ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def state_dict_for_save_checkpoint(
        self, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Copy into the parameters (which stay views into the weight buffer), then
        refresh the distributed optimizer's main-weight shard from them."""
        if assign:
            raise ValueError(
                f"{WHO}: load_state_dict(assign=True) would replace the parameters, which "
                "must stay views into the weight buffer; load with assign=False"
            )
        result = self.module.load_state_dict(state_dict, strict=strict)
        with torch.no_grad():
            for group in self.buffer.groups:
                main, model = group.main_weight_buffer, group.model_weight_buffer
                if main is None or model is None:
                    continue
                if main.is_data_distributed or model.is_data_distributed:
                    main.local_shard.copy_(model.local_shard)
                else:
                    main.data.copy_(model.data)
        return result

    # ---- accounting ------------------------------------------------------------------------
    def comm_stats(self, reset: bool = False) -> dict[str, dict[str, float]]:
        """Collectives issued since the last reset, by kind."""
        stats = self.buffer.stats.as_dict()
        if reset:
            self.buffer.stats.reset()
        return stats
