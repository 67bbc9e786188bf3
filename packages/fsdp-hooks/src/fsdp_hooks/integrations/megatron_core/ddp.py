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
    Or let Megatron-Core's ``DistributedOptimizer`` step it: ``model.buffers`` is its
    view of fsdp's buffers (``ddp_megatron_view``), one bucket per parameter, so its
    arithmetic owns exactly the rows fsdp reduce-scattered to this rank.
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
    GradStaging,
    MixedPrecisionPolicy,
    ParamAndGradBuffer,
    ShardingStrategy,
)
from fsdp_hooks.integrations.megatron_core._common import (
    GradBufferList,
    dist_index_over,
    index_from_pg_collection,
    set_is_first_microbatch,
    transformer_option,
)
from fsdp_hooks.integrations.megatron_core.ddp_checks import WHO, effective_ddp_config
from fsdp_hooks.integrations.megatron_core.ddp_grads import DDPGradHooks
from fsdp_hooks.integrations.megatron_core.ddp_megatron_view import (
    MegatronBucketGroupView,
    WeightsOwner,
    megatron_buffer_views,
)
from fsdp_hooks.module.inner_module import InnerModuleAttributes
from fsdp_hooks.module.unused_options import options_set, warn_unused_options
from fsdp_hooks.setup.validation import (
    check_no_meta_params,
    check_not_wrapped,
    check_option_types,
    check_same_model,
)
from fsdp_mesh.device import warn_once

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
    check_no_meta_params(
        module,
        WHO,
        "materialize the module first (meta-device initialization is a "
        "FullyShardedDataParallel feature)",
    )
    devices = {p.device for p in module.parameters()}
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


_OWNER_NAMES = {
    WeightsOwner.FSDP_SHARDS: "a torch optimizer over distributed_optimizer_params()",
    WeightsOwner.MEGATRON_DISTOPT: (
        "Megatron-Core's DistributedOptimizer (it read model.buffers' buckets)"
    ),
}


class DistributedDataParallel(InnerModuleAttributes):
    """Megatron-Core's ``DistributedDataParallel(config, ddp_config, module, ...)``.

    Args:
        config: a transformer config (any object, or None); ``calculate_per_token_loss``
            is read (sum gradients instead of averaging them over ranks).
        ddp_config: ``DistributedDataParallelConfig`` (fsdp's or Megatron-Core's), a
            dict of its fields, or None. Read: ``grad_reduce_in_fp32``,
            ``overlap_grad_reduce``, ``use_distributed_optimizer``,
            ``check_for_nan_in_grad``, ``bucket_size``, ``average_in_collective``.
        module: the model, on this rank's device, the same on every rank.
        disable_bucketing: one bucket per dtype (as without ``overlap_grad_reduce``).
        pg_collection: Megatron-Core's ProcessGroupCollection; its ``dp_cp`` group (or
            ``dp``) is the data-parallel group. Other parallel groups must have one rank.
        full_param_layout: Megatron-Core's precomputed buffer layout (Megatron-LM passes
            one with the distributed optimizer). Accepted and ignored, with a warning:
            fsdp lays out its own buffers, and ``model.buffers`` describes that layout
            to Megatron-Core's ``DistributedOptimizer``.
        data_parallel_group: this rank's group to reduce gradients over (default: the
            world); it may be part of the world, beside tensor or pipeline groups.
            Keyword only (fsdp's; Megatron-Core passes ``pg_collection``).
        accumulate_allreduce_grads_in_fp32, overlap_grad_reduce,
        use_distributed_optimizer, check_for_nan_in_grad: override the ``ddp_config``
            fields of the same meaning when given (the older Megatron-Core signature;
            keyword only).

    As in Megatron-Core, ``model.buffers`` is the list of gradient buffers (Megatron-Core's
    view of ``model.buffer``, one per parameter and gradient dtype, what its
    ``DistributedOptimizer`` reads), ``model.bucket_groups`` their groups, and
    ``model.expert_parallel_buffers`` the expert ones (none); ``model.buffers()`` still
    iterates the module's registered buffers.

    See the module note for what the optimizer reads and when.
    """

    def __init__(
        self,
        config: object,
        ddp_config: object = None,
        module: nn.Module | None = None,
        disable_bucketing: bool = False,
        pg_collection: Any = None,
        full_param_layout: Any = None,
        *,
        data_parallel_group: dist.ProcessGroup | None = None,
        accumulate_allreduce_grads_in_fp32: bool | None = None,
        overlap_grad_reduce: bool | None = None,
        use_distributed_optimizer: bool | None = None,
        check_for_nan_in_grad: bool | None = None,
    ) -> None:
        super().__init__()
        check_option_types(
            WHO, DistributedDataParallel.__init__, {"disable_bucketing": disable_bucketing}
        )
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
        if pg_collection is not None and data_parallel_group is not None:
            raise ValueError(
                f"{WHO}: pass either pg_collection (Megatron-Core's) or data_parallel_group, "
                "not both"
            )
        if full_param_layout is not None:
            warn_once(
                "fsdp.ignored.full_param_layout",
                f"{WHO}: full_param_layout is accepted and ignored: fsdp lays out its own "
                "gradient buffers (the layout serves Megatron-Core's DistributedOptimizer)",
            )
        if pg_collection is not None:
            dist_index = index_from_pg_collection(pg_collection, WHO)
        else:
            dist_index = dist_index_over(data_parallel_group, WHO)
        device = _module_device(module, dist_index.device_type)
        warn_unused_options(device, WHO, options_set(cfg))
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
            # Megatron-Core's optimizers and fused wgrad read and write param.main_grad.
            grad_staging=GradStaging.MAIN_GRAD,
        )
        self._weights_owner = WeightsOwner.UNCLAIMED
        self.buffers = GradBufferList(
            self,
            megatron_buffer_views(
                self.buffer, cfg, self.data_parallel_group, self._claim_for_megatron_optimizer
            ),
        )
        self.bucket_groups: list[MegatronBucketGroupView] = [
            group for view in self.buffers for group in view.bucket_groups
        ]
        self.expert_parallel_buffers: list[Any] = []
        self.expert_parallel_bucket_groups: list[MegatronBucketGroupView] = []
        self.pg_collection = pg_collection
        self._forward_pre_hook_enabled = self._uses_forward_pre_hook
        self._grad_buffers_offloaded = False
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

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """Reduce whatever is still unreduced, wait for every reduction, and raise on
        every rank if ``check_for_nan_in_grad`` found NaN/Inf in a local gradient.

        ``force_all_reduce`` (Megatron-Core's ``finalize_model_grads`` passes it) asks
        Megatron-Core's buckets to all-reduce instead of reduce-scatter; here it is
        accepted, and only ``False``/``None`` are honoured: with the distributed
        optimizer gradients are reduce-scattered, so ``True`` there raises."""
        if force_all_reduce and self.ddp_config.use_distributed_optimizer:
            raise NotImplementedError(
                f"{WHO}: finish_grad_sync(force_all_reduce=True) with "
                "use_distributed_optimizer=True is not implemented: gradients are "
                "reduce-scattered into this rank's shard"
            )
        self.grad_reduce_pipeline.reduce_accumulated()
        self._hooks.raise_if_nonfinite(self.data_parallel_group)
        self.buffer.views.attach_grads()

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
            for bucket in self.buffer.buckets:
                bucket.grads.forget_grads()
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
        self._claim_weights(WeightsOwner.FSDP_SHARDS)
        # Gradients in another dtype than the fp32 main weights (grad_reduce_in_fp32
        # off) reach the optimizer cast to fp32, as in Megatron-Core.
        return [p for _name, p in self.buffer.views.optimizer_named_parameters()]

    def start_param_sync(self, *unused: Any, force_sync: bool = False) -> None:
        """Distributed optimizer: copy this rank's stepped shard into the parameters and
        all-gather them, so every rank holds the whole updated model. No-op otherwise.
        Under Megatron-Core's ``DistributedOptimizer`` the stepped shard is this rank's
        rows of the parameters (it writes ``param_data``)."""
        if self._weights_owner is WeightsOwner.MEGATRON_DISTOPT:
            for group in self.bucket_groups:
                self._start_bucket_group_param_sync(group, force_sync=force_sync)
            return
        self.buffer.install_optimized_model_weights()

    def _start_bucket_group_param_sync(
        self, bucket_group: MegatronBucketGroupView, force_sync: bool = False
    ) -> None:
        """Megatron-Core's ``DistributedOptimizer`` calls this after its step, for each
        of ``bucket_groups``: all-gather this rank's rows of the parameters (which it
        has just written) into every rank's parameters. Synchronous."""
        self._claim_weights(WeightsOwner.MEGATRON_DISTOPT)
        bucket = bucket_group.fsdp_bucket
        main, model = bucket.group.main_weight_buffer, bucket.group.model_weight_buffer
        with torch.no_grad():
            if main is not None and model is not None:
                main.copy_shard_from(model)  # the same values: the install copies them back
            pending = bucket.start_install()
            if pending is not None:
                pending.wait()

    def _claim_for_megatron_optimizer(self) -> None:
        """Megatron-Core's ``DistributedOptimizer`` reads the buffer views: check that
        this adapter can serve it, and hand it the weights."""
        cfg = self.ddp_config
        if not cfg.use_distributed_optimizer:
            raise RuntimeError(
                f"{WHO}: Megatron-Core's DistributedOptimizer needs the model wrapped with "
                "use_distributed_optimizer=True (gradients reduce-scattered into the rows "
                "it steps); with all-reduce use its non-distributed optimizer "
                "(use_distributed_optimizer=False in OptimizerConfig)"
            )
        if cfg.overlap_param_gather:
            raise RuntimeError(
                f"{WHO}: Megatron-Core's DistributedOptimizer with overlap_param_gather=True "
                "leaves the parameter all-gather to forward pre-hooks, which this adapter "
                "does not register (its gathers are synchronous); set "
                "overlap_param_gather=False in the DistributedDataParallelConfig"
            )
        self._claim_weights(WeightsOwner.MEGATRON_DISTOPT)

    def _claim_weights(self, owner: WeightsOwner) -> None:
        if self._weights_owner in (WeightsOwner.UNCLAIMED, owner):
            self._weights_owner = owner
            return
        raise RuntimeError(
            f"{WHO}: the updated weights are already written by "
            f"{_OWNER_NAMES[self._weights_owner]}; they cannot also come from "
            f"{_OWNER_NAMES[owner]} (each would overwrite the other's step). Use one "
            "optimizer per model."
        )

    def broadcast_params(self) -> None:
        """Make every rank's parameters equal to data-parallel rank 0's."""
        self.buffer.broadcast_params()

    # ---- Megatron-Core's training-loop hooks -------------------------------------------
    @property
    def _uses_forward_pre_hook(self) -> bool:
        # Megatron-Core registers forward pre-hooks (waiting for parameter all-gathers)
        # exactly when the distributed optimizer overlaps the parameter gather.
        cfg = self.ddp_config
        return bool(cfg.use_distributed_optimizer and cfg.overlap_param_gather)

    def enable_forward_pre_hook(self) -> None:
        """Megatron-Core's pre-hooks wait, module by module, for parameter all-gathers
        launched asynchronously. Here ``start_param_sync`` gathers synchronously, so
        there is nothing to wait for; the call is checked as Megatron-Core checks it
        (only with the distributed optimizer and ``overlap_param_gather``, and not
        twice)."""
        self._check_forward_pre_hook("enable_forward_pre_hook")
        if self._forward_pre_hook_enabled:
            raise RuntimeError(f"{WHO}: enable_forward_pre_hook(): the hooks are already enabled")
        self._forward_pre_hook_enabled = True

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """As Megatron-Core: the pre-hooks are off, and with ``param_sync`` the
        parameters are synchronized now (``start_param_sync(force_sync=True)``)."""
        self._check_forward_pre_hook("disable_forward_pre_hook")
        if not self._forward_pre_hook_enabled:
            raise RuntimeError(f"{WHO}: disable_forward_pre_hook(): the hooks are already disabled")
        self._forward_pre_hook_enabled = False
        if param_sync:
            with torch.no_grad():
                self.start_param_sync(force_sync=True)

    def _check_forward_pre_hook(self, what: str) -> None:
        if not self._uses_forward_pre_hook:
            raise RuntimeError(
                f"{WHO}: {what}() needs ddp_config.use_distributed_optimizer=True and "
                "overlap_param_gather=True (Megatron-Core has forward pre-hooks only then)"
            )

    def set_is_first_microbatch(self) -> None:
        """Megatron-Core's: with a quantizing transformer config (fp8, fp4, kitchen or a
        quant recipe), flag every submodule that has ``is_first_microbatch``."""
        set_is_first_microbatch(self, self.config)

    def _grad_tensors(self) -> list[torch.Tensor]:
        # Released sharded gradients hold no memory (reading them would allocate zeros).
        return [
            group.main_grad_buffer.data
            for group in self.buffer.groups
            if group.main_grad_buffer is not None and not group.main_grad_buffer.is_released
        ]

    def offload_grad_buffers(self, synchronize: bool = True, empty_cache: bool = True) -> None:
        """Free the gradient buffers' memory (Megatron-Core's): their storage is resized
        to zero, so every ``param.main_grad`` view stays a valid object but must not
        be read until ``restore_grad_buffers()``."""
        if self._grad_buffers_offloaded:
            raise RuntimeError(f"{WHO}: offload_grad_buffers(): already offloaded")
        cuda = self.buffer.device.type == "cuda"
        if synchronize and cuda:
            torch.cuda.synchronize()
        for data in self._grad_tensors():
            data.untyped_storage().resize_(0)
        self._grad_buffers_offloaded = True
        if empty_cache and cuda:
            torch.cuda.empty_cache()

    def restore_grad_buffers(self, synchronize: bool = True) -> None:
        """Reallocate the gradient buffers, zeroed; the ``main_grad`` views are valid
        again (they share the storage)."""
        if not self._grad_buffers_offloaded:
            raise RuntimeError(
                f"{WHO}: restore_grad_buffers() without offload_grad_buffers() before"
            )
        for data in self._grad_tensors():
            data.untyped_storage().resize_(data.numel() * data.element_size())
            data.zero_()
        self._grad_buffers_offloaded = False
        if synchronize and self.buffer.device.type == "cuda":
            torch.cuda.synchronize()

    # ---- state dicts ---------------------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict, under its own names (no ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def state_dict_for_save_checkpoint(
        self, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix: str = "", *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's ``sharded_state_dict`` (Megatron-Core's distributed
        checkpointing), as Megatron-Core's wrappers delegate it."""
        inner = getattr(self.module, "sharded_state_dict", None)
        if not callable(inner):
            raise AttributeError(
                f"{WHO}: the wrapped {type(self.module).__name__} has no sharded_state_dict(); "
                "it is a Megatron-Core MegatronModule method (use state_dict() otherwise)"
            )
        return inner(prefix, *args, **kwargs)

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
                main.copy_shard_from(model)
        return result

    # ---- accounting ------------------------------------------------------------------------
    def comm_stats(self, reset: bool = False) -> dict[str, dict[str, float]]:
        """Collectives issued since the last reset, by kind."""
        stats = self.buffer.stats.as_dict()
        if reset:
            self.buffer.stats.reset()
        return stats
