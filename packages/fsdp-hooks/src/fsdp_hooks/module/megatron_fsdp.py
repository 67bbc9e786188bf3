"""``MegatronFSDP``: the wrapper module that schedules when the bytes move.

It owns a ``ParamAndGradBuffer`` and its two pipelines, and registers the hooks that
``hooks.py`` defines. Outside forward and backward the wrapped module's parameters are
DTensors holding this rank's shard of the main weights (with ``.grad`` on the main-grad
shard), so any torch optimizer, ``clip_grad_norm_`` and ``state_dict()`` work on them;
from the start of forward to the end of backward they are the compute parameters, whose
``.data`` are views into gathered buckets. Tied parameters are swapped at every place
they are reachable from, so they stay tied.

Around it: what wrapping does before storage moves (arguments checked and resolved, the
ranks agreed on the model) in ``wrap_checks``, the buffer built from ``ddp_config`` in
``wrapper_buffer``, state dicts in ``state_dicts``, the Megatron-FSDP/Megatron-Core
surface (``param_and_grad_buffer``'s view, the policy-reset rule) in ``megatron_compat``,
and ``generate`` in ``transformers_model``.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from fsdp_buffers import (
    AllGatherPipeline,
    GradReducePipeline,
    GradStaging,
    MixedPrecisionPolicy,
    PrefetchOrder,
    ShardingStrategy,
)
from fsdp_buffers.mixed_precision import cast_floating
from fsdp_hooks.diagnostics.activations import last_meter, measured_forward, measuring
from fsdp_hooks.diagnostics.memory_stats import measure_memory_stats
from fsdp_hooks.diagnostics.summary import log_unit_summary
from fsdp_hooks.module import state_dicts, transformers_model
from fsdp_hooks.module.config import DistributedDataParallelConfig
from fsdp_hooks.module.inner_module import InnerModuleAttributes
from fsdp_hooks.module.megatron_compat import MegatronParamAndGradBuffer, reset_policy
from fsdp_hooks.module.module_copies import (
    DEEPCOPY_REFUSED,
    check_unchanged,
    materialize_meta_buffers,
)
from fsdp_hooks.module.wrap_checks import check_and_resolve
from fsdp_hooks.module.wrapper_buffer import build_buffer
from fsdp_hooks.optim.grad_norm import clip_grad_norm_
from fsdp_hooks.runtime.config import RuntimeCallbacks, RuntimeConfig
from fsdp_hooks.runtime.hooks import FSDPHooks
from fsdp_hooks.runtime.training_state import TrainingState
from fsdp_hooks.setup.meta_init import (
    defer_meta_init,
    initialize_from_meta,
    prepare_meta_init,
    run_model_init_weights,
)
from fsdp_hooks.setup.rollback import rollback_on_failure

__all__ = ["MegatronFSDP"]

logger = logging.getLogger("fsdp_hooks")


class MegatronFSDP(InnerModuleAttributes):
    """Fully Sharded Data Parallel training of ``module`` over ``dist_index``'s groups.

    Strategies (``ddp_config.data_parallel_sharding_strategy``): ``no_shard`` (plain
    data parallel), ``optim`` (~ZeRO-1: main weights and optimizer state sharded),
    ``optim_grads`` (~ZeRO-2: also gradients), ``optim_grads_params`` (~ZeRO-3: also
    the compute weights, gathered per FSDP unit for forward and again for backward).
    """

    _is_fsdp_wrapper = True

    def __init__(
        self,
        module: nn.Module,
        dist_index,  # fsdp_mesh.FSDPDistributedIndex
        ddp_config: DistributedDataParallelConfig | None = None,
        mixed_precision_policy: MixedPrecisionPolicy | None = None,
        fsdp_unit_modules: Iterable[type[nn.Module] | str] | None = None,
        disable_bucketing: bool = False,
        device: torch.device | str | int | None = None,
        calculate_per_token_loss: bool = False,
        init_model_with_meta_device: bool = False,
        sync_model_each_microbatch: bool = False,
        keep_fp8_transpose_cache: bool = False,
        nccl_ub: bool = False,
        fsdp_double_buffer: bool = False,
        fsdp_db_use_persist_buf_on_alloc_fail: bool = False,
        disable_symmetric_registration: bool = False,
        enable_fine_grained_param_gather_hook: bool = False,
        enable_fine_grained_param_gather_backward_hook: bool = False,
        fine_grained_recurse_module_types: tuple[type[nn.Module], ...] | None = None,
        report_nan_in_param_grad: bool = False,
        *,
        is_expert_param: Callable[[str, nn.Parameter], bool] | str | None = None,
        prefetch_depth: int = 1,
        regather_saved_weights: bool = False,
        grad_staging: GradStaging | str = GradStaging.AUTOGRAD,
    ) -> None:
        super().__init__()
        settings = check_and_resolve(
            module,
            dist_index,
            ddp_config,
            mixed_precision_policy,
            fsdp_unit_modules,
            {  # types checked first, alike on every rank (Note [option types])
                "disable_bucketing": disable_bucketing,
                "device": device,
                "calculate_per_token_loss": calculate_per_token_loss,
                "init_model_with_meta_device": init_model_with_meta_device,
                "sync_model_each_microbatch": sync_model_each_microbatch,
                "keep_fp8_transpose_cache": keep_fp8_transpose_cache,
                "nccl_ub": nccl_ub,
                "fsdp_double_buffer": fsdp_double_buffer,
                "fsdp_db_use_persist_buf_on_alloc_fail": fsdp_db_use_persist_buf_on_alloc_fail,
                "disable_symmetric_registration": disable_symmetric_registration,
                "enable_fine_grained_param_gather_hook": enable_fine_grained_param_gather_hook,
                "enable_fine_grained_param_gather_backward_hook": (
                    enable_fine_grained_param_gather_backward_hook
                ),
                "report_nan_in_param_grad": report_nan_in_param_grad,
                "prefetch_depth": prefetch_depth,
                "regather_saved_weights": regather_saved_weights,
            },
            signature=MegatronFSDP.__init__,
            fine_grained_recurse_module_types=fine_grained_recurse_module_types,
            is_expert_param=is_expert_param,
            grad_staging=grad_staging,
        )
        self.ddp_config = ddp_config = settings.ddp_config
        self.dist_index = dist_index
        self.device = settings.device
        self.strategy = settings.strategy
        self.outer_strategy = settings.outer_strategy
        self.mixed_precision_policy = settings.mixed_precision_policy
        self.calculate_per_token_loss = calculate_per_token_loss
        self.init_model_with_meta_device = init_model_with_meta_device
        # Under ZeRO-3: gather a released unit weight again when a backward reads it
        # outside the unit's own backward (Note [released weights read later]).
        self.regather_saved_weights = regather_saved_weights
        self.report_nan_in_param_grad = report_nan_in_param_grad or ddp_config.check_for_nan_in_grad
        # Megatron-FSDP's step bookkeeping: backwards since the last finish_grad_sync, and
        # whether the caller flagged this microbatch as the last (it reduces everything).
        self.microbatch_count = 0
        self._is_last_microbatch = False
        self.module = module
        # From here storage moves into buffers: a failure on any rank restores the module
        # on every rank (agreed at the end); ZeRO-3 keeps the original values until then.
        with rollback_on_failure(
            module,
            dist_index.get_dp_group() if torch.distributed.is_initialized() else None,
            keep_values=self.strategy is ShardingStrategy.OPTIM_GRADS_PARAMS,
        ):
            # Meta parameters without the flag: FSDP2's route, the user's init_weights()
            # after wrapping (Note [the model's init_weights] in meta_init).
            deferred_init = not init_model_with_meta_device and any(
                p.is_meta for p in module.parameters()
            )
            left_to_init_weights: list[tuple[nn.Module, str, str]] = []
            if init_model_with_meta_device or deferred_init:
                # Meta parameters get placeholders on self.device in place (see meta_init).
                prepare_meta_init(module, self.device)
            self.buffer = build_buffer(
                module,
                dist_index,
                ddp_config,
                strategy=self.strategy,
                mixed_precision_policy=self.mixed_precision_policy,
                fsdp_unit_modules=fsdp_unit_modules,
                disable_bucketing=disable_bucketing,
                device=self.device,
                fsdp_double_buffer=fsdp_double_buffer,
                nccl_ub=nccl_ub,
                calculate_per_token_loss=calculate_per_token_loss,
                is_expert_param=is_expert_param,
                allow_meta=init_model_with_meta_device or deferred_init,
                tensor_parallel=settings.tensor_parallel,
                grad_staging=settings.grad_staging,
            )
            self.all_gather_pipeline = AllGatherPipeline(
                self.buffer, follow_observed_order=True, prefetch_depth=prefetch_depth
            )
            self.grad_reduce_pipeline = GradReducePipeline(self.buffer)
            if init_model_with_meta_device:
                left_to_init_weights = initialize_from_meta(self)
            elif deferred_init:
                defer_meta_init(self)
            self.model_auto_sync = sync_model_each_microbatch
            self._sync_override: bool | None = None
            self.hooks = FSDPHooks(
                self.buffer,
                self.all_gather_pipeline,
                self.grad_reduce_pipeline,
                RuntimeConfig(
                    module=self.module,
                    dist_index=self.dist_index,
                    overlap_grad_reduce=ddp_config.overlap_grad_reduce,
                    regather_saved_weights=regather_saved_weights,
                    report_nan=self.report_nan_in_param_grad,
                    experts_differ_across_ranks=self.experts_differ_across_ranks,
                ),
                self._runtime_callbacks(),
            )
            self._replace_param_with_distributed_if_needed()
            optimizer_params = self.buffer.views.optimizer_named_parameters()
            # As in a fresh module: no gradient before the first backward.
            self.buffer.views.drop_grads()
            for _name, dparam in optimizer_params:
                # Megatron-FSDP's marker: Megatron-Core's optimizers then read the local
                # shard of .grad for the gradient norm (a DTensor grad otherwise).
                dparam.__fsdp_param__ = True
            self._state_names = state_dicts.expert_state_names(
                self.buffer, self.module, self.dist_index, self.experts_differ_across_ranks
            )
            # Megatron-FSDP's flag, recorded: its preprocessing measures where uneven pieces
            # lie; fsdp's pieces are DTensor's torch.chunk ones, so DCP's own metadata is
            # already exact and nothing (no collective) is done per state_dict().
            self.preproc_state_dict_for_dcp_ckpt = False
            # Meta buffers no reset_parameters() reaches: the model's own init_weights(),
            # on the wrapped model, as its user would call it on FSDP2's.
            if left_to_init_weights:
                run_model_init_weights(module, self.device, left_to_init_weights)
                self.install_optimized_model_weights()  # its writes, into the compute weights
            log_unit_summary(self)

    def _runtime_callbacks(self) -> RuntimeCallbacks:
        """What the runtime asks this wrapper, through weak references (the runtime
        keeps no wrapper alive; a call after the wrapper is gone raises)."""
        ref = weakref.ref(self)

        def model() -> MegatronFSDP:
            wrapper = ref()
            if wrapper is None:
                raise RuntimeError("the MegatronFSDP model of these hooks no longer exists")
            return wrapper

        def install_main_weights() -> None:
            wrapper = model()
            wrapper.install_optimized_model_weights(defer=wrapper.ddp_config.overlap_param_gather)

        def backward_ended() -> None:
            model().microbatch_count += 1

        return RuntimeCallbacks(
            sync_grads=lambda: model().sync_grads,
            install_main_weights=install_main_weights,
            backward_ended=backward_ended,
            owner=ref,
        )

    # ---- state ----------------------------------------------------------------------
    @property
    def report_nan_in_param_grad(self) -> bool:
        """Check every gradient for NaN/Inf, agreed across ranks at the sync (Megatron-
        FSDP's attribute; settable at any time)."""
        return self.__dict__["_report_nan_in_param_grad"]

    @report_nan_in_param_grad.setter
    def report_nan_in_param_grad(self, value: bool) -> None:
        self.__dict__["_report_nan_in_param_grad"] = value
        hooks = self.__dict__.get("hooks")
        if hooks is not None:  # the runtime reads its own flag once per gradient
            hooks.report_nan = value

    @property
    def experts_differ_across_ranks(self) -> bool:
        """Expert parallelism: an expert mesh whose data-parallel size differs from the
        dense one, so ranks hold different experts under the same local names."""
        return self.dist_index.expt_dp_size != self.dist_index.dp_size

    @property
    def training_state(self) -> TrainingState:
        return self.hooks.root_state

    def unit_training_state(self, unit_id: int) -> TrainingState:
        return self.hooks.units[unit_id].state

    @property
    def sync_grads(self) -> bool:
        """Whether the backward running now (or next) reduces every gradient: inside
        ``no_sync()``/``sync()`` as they say, else when ``model_auto_sync`` or
        ``is_last_microbatch`` is set (Megatron-FSDP's rule). Only a backward that
        reduces every gradient attaches ``.grad`` at its end; otherwise ``.grad`` stays
        empty until ``finish_grad_sync()``, as in Megatron-FSDP."""
        if self._sync_override is not None:
            return self._sync_override
        return self.model_auto_sync or self._is_last_microbatch

    @property
    def is_last_microbatch(self) -> bool:
        return self._is_last_microbatch

    @is_last_microbatch.setter
    def is_last_microbatch(self, value: bool) -> None:
        self._is_last_microbatch = bool(value)

    # ---- Megatron-FSDP's buffer and mixed-precision surface ----------------------------
    @property
    def param_and_grad_buffer(self) -> MegatronParamAndGradBuffer:
        """The ``ParamAndGradBuffer`` as Megatron-FSDP and Megatron-Core's optimizer
        read it (``parameter_groups``, ``copy_main_weights_to_model_weights()``; other
        attributes are the buffer's)."""
        view = self.__dict__.get("_param_and_grad_buffer_view")
        if view is None:
            view = self.__dict__["_param_and_grad_buffer_view"] = MegatronParamAndGradBuffer(self)
        return view

    @property
    def mp_policy(self) -> MixedPrecisionPolicy:
        return self.mixed_precision_policy

    def reset_mixed_precision_policy(self, mixed_precision_policy: MixedPrecisionPolicy) -> None:
        """Megatron-FSDP's: keep the main weight and gradient dtypes (the buffers are
        allocated in them) and take ``grad_comm_dtype`` from the new policy (gradients
        are communicated in it from the next reduction on)."""
        self.mixed_precision_policy = reset_policy(
            self.mixed_precision_policy, mixed_precision_policy
        )
        self.buffer.policy = self.mixed_precision_policy

    @contextlib.contextmanager
    def mixed_precision_context(
        self, mixed_precision_policy: MixedPrecisionPolicy
    ) -> Iterator[None]:
        """``reset_mixed_precision_policy`` inside, the previous policy restored after."""
        previous = self.mixed_precision_policy
        self.reset_mixed_precision_policy(mixed_precision_policy)
        try:
            yield
        finally:
            self.reset_mixed_precision_policy(previous)

    def get_distributed_index(self):
        return self.dist_index

    # ---- forward --------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # ``self.module`` as nn.Module finds it, without the step passing through
        # ``InnerModuleAttributes.__getattr__`` (its fallback) first.
        return self._root_call(self._modules["module"], inputs, kwargs)

    def _root_call(self, fn: Callable[..., Any], inputs: tuple, kwargs: dict) -> Any:
        """``fn(*inputs, **kwargs)`` as one root forward: the root groups gathered and the
        compute parameters in place around it, the policy's input and output casts."""
        policy = self.mixed_precision_policy
        if policy.cast_forward_inputs and policy.param_dtype is not None:
            inputs, kwargs = cast_floating((inputs, kwargs), policy.param_dtype)
        inputs, kwargs = self.hooks.root_pre_forward(inputs, kwargs)
        meter = self.__dict__.get("_activation_meter")
        if meter is None:
            with self.hooks.saved_weights.saved_weights_hooks():
                output = fn(*inputs, **kwargs)
        else:
            output = measured_forward(self, meter, lambda: fn(*inputs, **kwargs))
        output = self.hooks.root_post_forward(output)
        if policy.output_dtype is not None:
            output = cast_floating(output, policy.output_dtype)
        return output

    def save_pretrained(self, directory: Any, **kwargs: Any) -> None:
        """``fsdp.save_pretrained(self, directory, **kwargs)``: the wrapped transformers
        model written as its ``save_pretrained`` does, consolidated. Call on every rank."""
        transformers_model.save_pretrained(self, directory, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``generate`` (a Hugging Face ``GenerationMixin``), every
        forward it makes run as the wrapper's forward does: parameters gathered unit by
        unit (ZeRO-3 included) and released after each step. Same tokens as the
        unwrapped model."""
        return transformers_model.generate(self, *args, **kwargs)

    # ---- parameter views ------------------------------------------------------------
    def _replace_param_with_distributed_if_needed(self) -> None:
        self.hooks.swap.use_distributed_params()

    # ---- gathers --------------------------------------------------------------------
    def all_gather_and_wait_parameters_ready(
        self,
        params: Iterable[nn.Parameter],
        prefetch: bool = True,
        prefetch_order: PrefetchOrder = PrefetchOrder.FORWARD_PASS_ORDER,
        wait_bucket_ready: bool = True,
    ) -> None:
        gids = sorted({self.hooks.swap.group_of_any(p) for p in params})
        self.all_gather_pipeline.all_gather_params(
            gids,
            prefetch=prefetch,
            prefetch_order=prefetch_order,
            wait_bucket_ready=wait_bucket_ready,
        )

    def start_param_sync(
        self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False
    ) -> None:
        """Gather every sharded bucket: asynchronously when ``overlap_param_gather`` (or
        ``force_dispatch``), and waited for when not (or ``force_sync``)."""
        pipeline = self.all_gather_pipeline
        pipeline.land_stale()  # ZeRO-1/2 buckets a step left stale, if any
        for gid in pipeline.forward_order:
            pipeline.async_bucket_gather(gid)
        wait = force_sync or not (self.ddp_config.overlap_param_gather or force_dispatch)
        if wait:
            self.synchronize_param_gather()

    def synchronize_param_gather(self) -> None:
        pipeline = self.all_gather_pipeline
        pipeline.land_stale()
        for gid in pipeline.gathered_buckets():
            pipeline.wait_bucket_ready(gid)

    # ---- gradients --------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate replicated gradients without reducing them
        (``no_shard``/``optim``); sharded gradients are always reduce-scattered."""
        previous, self._sync_override = self._sync_override, False
        try:
            yield
        finally:
            self._sync_override = previous

    @contextlib.contextmanager
    def sync(self) -> Iterator[None]:
        """Backwards inside reduce every gradient before they return."""
        previous, self._sync_override = self._sync_override, True
        try:
            yield
        finally:
            self._sync_override = previous

    def set_model_auto_sync(self, sync_model: bool = True) -> None:
        self.model_auto_sync = sync_model

    def start_grad_sync(self, *unused: Any) -> None:
        """Launch the reduction of every bucket not reduced yet (outside backward)."""
        self.grad_reduce_pipeline.reduce_accumulated()

    def synchronize_gradient_reduce(self) -> None:
        self.grad_reduce_pipeline.wait_all()

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """Reduce whatever is still unreduced, wait for every reduction, check for
        NaN/Inf when asked, and attach the main-grad shards to the parameters.
        ``force_all_reduce`` is accepted for Megatron-Core's ``finalize_model_grads``
        and, as in Megatron-FSDP, has no effect."""
        self.hooks.publish_grads()
        self.microbatch_count = 0

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the main gradients, correct in every
        mode, expert parallelism included (torch's cannot mix the dense and expert
        meshes; see ``grad_norm``). Reduces what is still unreduced first
        (``finish_grad_sync``), so call it after the last backward of a step."""
        self.finish_grad_sync()
        split = self.experts_differ_across_ranks
        return clip_grad_norm_(
            self.buffer,
            max_norm,
            expert_replicas=self.dist_index.expt_dp_size if split else None,
            norm_type=norm_type,
            error_if_nonfinite=error_if_nonfinite,
            foreach=foreach,
        )

    @property
    def use_decoupled_grad(self) -> bool:
        """Gradients go to the optimizer parameters' ``.decoupled_grad`` (Megatron-FSDP's
        ``use_decoupled_grad``), not ``.grad``."""
        return self.buffer.views.grad_attr == "decoupled_grad"

    def attach_grad_to_optimizer_state(self) -> None:
        """Point ``.grad`` of the optimizer's parameters at their main-grad shards, in
        the groups a backward filled since ``zero_grad_buffer`` (a step without
        backward after ``zero_grad()`` then behaves as in plain PyTorch)."""
        self.hooks.attach_grads(only_with_grads=True)

    def scale_gradients(self, scaling_factor: float) -> None:
        self.buffer.scale_gradients(scaling_factor)

    def zero_grad_buffer(self) -> None:
        self.hooks.recover_if_backward_aborted()  # reductions in flight land first
        if self.use_decoupled_grad:
            # Megatron-FSDP drops .decoupled_grad here; first, so that sharded gradients
            # no optimizer parameter holds are released, not zeroed (Note [released
            # gradients]).
            self.buffer.views.drop_grads()
        self.buffer.zero_grad_buffer()
        self.hooks.clear_nonfinite_grads()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's ``Module.zero_grad`` on the parameters users see (the DTensors):
        with ``set_to_none`` their ``.grad`` is dropped, so sharded gradients nothing
        else holds are released (Note [released gradients]), as FSDP2's are; else it
        stays, zeroed. The gradient buffers are zeroed either way."""
        if set_to_none:
            self.hooks.recover_if_backward_aborted()  # reductions in flight land first
            self.buffer.views.drop_grads()
            for p in self.module.parameters():  # a whole-placed one's WholeParameter too
                p.grad = None
        self.zero_grad_buffer()

    # ---- weights ----------------------------------------------------------------------
    def install_optimized_model_weights(self, *, defer: bool = False) -> None:
        """Copy the main weights into the compute weights (after an optimizer step, or
        in-place writes to the parameters; the next forward does it by itself when a
        main weight's version moved since the last install). ``defer`` (what the
        optimizer step passes with ``overlap_param_gather``): ZeRO-1/2 buckets are left
        STALE, and the next forward gathers them with forward prefetch (Note [stale
        buckets] in ``fsdp_buffers.all_gather_pipeline``)."""
        self.all_gather_pipeline.reset()  # gathered copies are stale after a step
        hooks = self.hooks
        self.buffer.install_optimized_model_weights(hooks.swap.stale_after_step if defer else ())
        hooks.params.record_versions()

    def broadcast_params(self) -> None:
        self.all_gather_pipeline.reset()
        self.buffer.broadcast_params()

    # ---- state dicts ------------------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict, under its own names (no ``module.``
        prefix) with experts under their global index (see ``expert_names``):
        DTensors holding this rank's shard of the main weights."""
        return state_dicts.state_dict(self.hooks, self.module, self._state_names, args, kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load into the main weights (DTensors of the same placement), then refresh the
        compute weights from them. Experts are named as ``state_dict()`` names them;
        other ranks' experts are unexpected keys."""
        return state_dicts.load_state_dict(
            self.hooks,
            self.module,
            self._state_names,
            state_dict,
            strict,
            assign,
            self.install_optimized_model_weights,
        )

    # ---- copies and casts (see module_copies) --------------------------------------------
    def __deepcopy__(self, memo: dict[int, Any]) -> MegatronFSDP:
        raise TypeError(DEEPCOPY_REFUSED)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        materialize_meta_buffers(self.module, fn)  # to_empty after FSDP2's meta route
        check_unchanged(self, fn)  # a cast or a move is refused before anything changes
        return self  # nothing would change: a no-op (super() would replace the DTensors)

    # ---- accounting -------------------------------------------------------------------
    def comm_stats(self, reset: bool = False) -> dict[str, dict[str, float]]:
        """Collectives issued since the last reset: calls, unsharded elements and bytes,
        and ring traffic per rank, by kind."""
        stats = self.buffer.stats.as_dict()
        if reset:
            self.buffer.stats.reset()
        return stats

    def reset_comm_stats(self) -> None:
        self.buffer.stats.reset()

    def measure_activations(self) -> contextlib.AbstractContextManager[None]:
        """Forwards inside are measured: ``memory_stats()`` then reports the last one's
        ``activations`` (and ``peak`` on CUDA, whose peak statistics each measured
        forward resets); see ``fsdp_hooks.diagnostics.activations``."""
        return measuring(self.__dict__, self.buffer.device)

    def memory_stats(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """This rank's model-state bytes, measured from the buffers' storages (and the
        state tensors of ``optimizer``, or of the one ``fully_shard_optimizer`` attached):
        ``parameters``, ``main_weights``, ``main_grads``, ``optimizer_state``, ``total``;
        ``activations`` of the last forward run under ``measure_activations()`` (and
        ``peak`` on CUDA). The keys of ``fsdp.plan(...).per_rank``; see
        ``fsdp_hooks.diagnostics.memory_stats``."""
        if optimizer is None:
            ref = self.__dict__.get("_fsdp_optimizer_ref")
            optimizer = ref() if ref is not None else None
        return measure_memory_stats(self.buffer, optimizer, last_meter(self.__dict__))
