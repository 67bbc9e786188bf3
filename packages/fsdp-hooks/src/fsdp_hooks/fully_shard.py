"""``fully_shard_model``, ``fully_shard_optimizer`` and ``fully_shard``.

They take the keyword arguments of ``megatron_fsdp.fully_shard`` so that code written
for it runs unchanged. Differences a user may notice:

- ``fully_shard(module, optimizer)`` keeps the optimizer's parameter groups (and their
  hyperparameters, e.g. weight-decay groups): each original parameter is replaced in
  place by its DTensor main-weight parameter. Megatron-FSDP rebuilds a single group.
  State the optimizer already holds (Adagrad creates it in ``__init__``) moves onto the
  main-weight shards; optimizers that cannot step row shards are refused at wrap (see
  ``fsdp_hooks.optim.optimizers``). Whole-matrix optimizers (``torch.optim.Muon``) get their
  matrices placed whole on one rank each (Note [whole placement] in
  ``fsdp_buffers.layout``). ``fully_shard`` also takes a list of optimizers over disjoint
  parameters (Muon for hidden matrices, AdamW for the rest) and returns the list: the
  gradients are synchronised before the first of them steps and the weights installed
  once all have stepped (no extra communication); a forward before all have stepped
  raises.
- With no ``device_mesh``, the default is a mesh over the whole world on CUDA when
  NCCL is the default backend, else on CPU. Its shard dim is named ``dp_shard_dim``
  (``"dp_shard"`` when not given); a given ``tp_dim`` adds a trailing dim of size 1
  under that name, else the mesh is 1-D. Hybrid-sharding arguments (``dp_outer_dim``,
  ``hybrid_fsdp_group``, ``outer_dp_sharding_strategy``) are ignored there, with a
  warning, as Megatron-FSDP ignores them.
- Hybrid sharding: ``dp_outer_dim`` names the outer (replica) dim of ``device_mesh``;
  ``outer_dp_sharding_strategy="optim"`` (needs ``zero_dp_strategy`` 3) also shards
  main weights and optimizer state across it (fully-sharded HSDP). See Note [hybrid
  sharding] in ``fsdp_buffers.hybrid_sharding``. With
  ``sync_model_each_microbatch=False`` the outer gradient reduction runs once per step,
  in ``optimizer.step()`` (``finish_grad_sync``): call ``model.finish_grad_sync()``
  first if you read gradients before the step (``clip_grad_norm_``), or run the last
  microbatch's backward under ``model.sync()``.
- Expert parallelism: ``expt_device_mesh`` (see ``fsdp_mesh.build_device_mesh``) with
  expert parameters recognised as ``fsdp_hooks.features.experts`` documents (markers, the
  default name rule ``experts.``, or the extra keyword ``is_expert_param``): they get
  their own buckets, sharded and reduced over the expert mesh's ``dp_shard`` dim, with
  gradients scaled by 1/(dense data-parallel size) as in Megatron-Core. State dicts
  name experts by their global index (``fsdp_hooks.features.expert_names``). Clip with
  ``model.clip_grad_norm_`` (``torch.nn.utils.clip_grad_norm_`` cannot mix the dense
  and expert meshes). With hybrid sharding too (over the expert mesh's outer dim).
- Tensor parallelism: ``tp_dim`` names the tensor-parallel dim of ``device_mesh``.
  Parameters already split across it (DTensors from ``parallelize_module``, or
  Megatron-Core tensor-parallel parameters) are sharded across the data-parallel dims
  on top of their tensor-parallel piece; see Note [tensor parallelism] in
  ``fsdp_buffers.tensor_parallel`` (also with hybrid sharding; not yet with an expert
  mesh).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_buffers import GradStaging, MixedPrecisionPolicy, ShardingStrategy
from fsdp_buffers.whole_param import inner_of
from fsdp_hooks.features.whole_state import register_whole_optimizer_state
from fsdp_hooks.module.config import DistributedDataParallelConfig
from fsdp_hooks.module.megatron_fsdp import MegatronFSDP
from fsdp_hooks.optim.local_step import StepRound, patch_optimizer
from fsdp_hooks.optim.optim_init import init_optimizer_state
from fsdp_hooks.optim.optimizers import (
    check_optimizer_supported,
    inner_parameters,
    mark_whole_placement,
    move_state_to_main_weights,
    refuse_positional_expert_state_in_dcp,
    show_whole_parameters,
)
from fsdp_hooks.setup.validation import (
    check_argument_types,
    check_option_types,
    check_outer_strategy,
)
from fsdp_mesh import FSDPDistributedIndex, default_device_type
from fsdp_mesh.device import warn_once

__all__ = ["fully_shard", "fully_shard_model", "fully_shard_optimizer"]

DEFAULT_SHARD_DIM = "dp_shard"


def _default_mesh(dp_shard_dim: str, tp_dim: str | None) -> DeviceMesh:
    """The whole world on the shard dim, named as the caller named it (Megatron-FSDP
    names its default mesh after the arguments too); a given ``tp_dim`` becomes a
    trailing dim of size 1."""
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call dist.init_process_group() (or launch "
            "with torchrun) before fully_shard"
        )
    if tp_dim is not None and tp_dim == dp_shard_dim:
        raise ValueError(
            f"dp_shard_dim and tp_dim name the same dim ({tp_dim!r}); give them different "
            "names, or pass a device_mesh"
        )
    device_type = default_device_type()
    if tp_dim is None:
        return init_device_mesh(
            device_type, (dist.get_world_size(),), mesh_dim_names=(dp_shard_dim,)
        )
    return init_device_mesh(
        device_type, (dist.get_world_size(), 1), mesh_dim_names=(dp_shard_dim, tp_dim)
    )


def fully_shard_model(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    dp_shard_dim: str | None = None,
    dp_outer_dim: str | None = None,
    tp_dim: str | None = None,
    hybrid_fsdp_group: dist.ProcessGroup | None = None,
    hybrid_fsdp_expt_group: dist.ProcessGroup | None = None,
    expt_device_mesh: DeviceMesh | None = None,
    fsdp_group_ag: dist.ProcessGroup | None = None,
    expt_fsdp_group_ag: dist.ProcessGroup | None = None,
    fsdp_unit_modules: Sequence[type[nn.Module]] | Sequence[str] | None = None,
    zero_dp_strategy: str | int = 3,
    outer_dp_sharding_strategy: str | int = 0,
    device: torch.device | str | int | None = None,
    init_model_with_meta_device: bool = False,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True,
    sync_model_each_microbatch: bool = True,
    preproc_state_dict_for_dcp_ckpt: bool = True,
    report_nan_in_param_grad: bool = False,
    average_in_collective: bool = False,
    disable_bucketing: bool = False,
    calculate_per_token_loss: bool = False,
    keep_fp8_transpose_cache: bool = False,
    nccl_ub: bool = False,
    fsdp_double_buffer: bool = False,
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False,
    disable_symmetric_registration: bool = False,
    enable_fine_grained_param_gather: bool = False,
    use_decoupled_grad: bool = False,
    cuda_graph_mode: bool = False,
    maxpool_double_buffer: bool = False,
    is_expert_param: Callable[[str, nn.Parameter], bool] | str | None = None,
    suggested_communication_unit_size: int | None = None,
    prefetch_depth: int = 1,
    regather_saved_weights: bool = False,
    grad_staging: GradStaging | str = GradStaging.AUTOGRAD,
) -> MegatronFSDP:
    """Shard ``module`` and return the ``MegatronFSDP`` wrapper (the original module is
    ``wrapper.module``). Its parameters are then DTensors: this rank's shard of the
    main weights.

    fsdp's own options: ``suggested_communication_unit_size`` (elements; None: pairs
    of units under 65,536 elements under ZeRO-3, groups of up to four units under
    131,072 below it; 0: off) gathers and reduces consecutive FSDP units
    as one collective until each group holds at least that many parameter elements;
    ``prefetch_depth`` (default 1) is how many units (groups) are gathered ahead of the
    one in use, 0 for none. Peak gathered memory grows with both
    (``docs/guide/coalescing.md``). ``regather_saved_weights`` (default False; ZeRO-3)
    gathers a unit's released weights again when a backward reads them outside the
    unit's own backward (an auxiliary loss on the weights backpropagated on its own);
    by default such a backward raises (``docs/guide/faults.md``, "Gradient paths that
    bypass a unit's outputs"). ``grad_staging`` (``"autograd"``, the default, or ``"main_grad"``) is
    where a backward's gradients wait for their reduction: autograd's ``.grad``, or a
    staging buffer that ``param.main_grad`` views, for layers that add into
    ``main_grad`` themselves (fused wgrad, ``grad_added_to_main_grad``); Note [gradient
    staging] in ``fsdp_buffers.bucket_grads``."""
    # Every argument by name (nothing else is bound yet): Note [option types].
    typed = dict(locals())
    check_argument_types(
        "fully_shard_model",
        module,
        fsdp_unit_modules,
        device_mesh=(device_mesh, DeviceMesh, 'init_device_mesh("cuda", (8,), ...)'),
        expt_device_mesh=(expt_device_mesh, DeviceMesh, "fsdp_mesh.build_device_mesh(...)"),
        mixed_precision_policy=(
            mixed_precision_policy,
            MixedPrecisionPolicy,
            "MixedPrecisionPolicy(main_params_dtype=torch.float32, grad_comm_dtype=torch.bfloat16)",
        ),
    )
    check_option_types("fully_shard_model", fully_shard_model, typed)
    strategy = ShardingStrategy.parse(zero_dp_strategy)
    outer = ShardingStrategy.parse(outer_dp_sharding_strategy)
    if device_mesh is None:
        # As in megatron_fsdp: the default mesh has no outer dim, so hybrid sharding
        # options are dropped (with a warning rather than silently).
        dropped = {
            "dp_outer_dim": dp_outer_dim is not None,
            "hybrid_fsdp_group": hybrid_fsdp_group is not None,
            "outer_dp_sharding_strategy": outer is not ShardingStrategy.NO_SHARD,
        }
        for name in (n for n, given in dropped.items() if given):
            warn_once(
                f"fsdp.ignored.default_mesh.{name}",
                f"{name} is ignored without a device_mesh: the default mesh has no outer "
                "data-parallel dim; pass a device_mesh with one for hybrid sharding",
            )
        dp_outer_dim, hybrid_fsdp_group, outer = None, None, ShardingStrategy.NO_SHARD
        dp_shard_dim = dp_shard_dim or DEFAULT_SHARD_DIM
        device_mesh = _default_mesh(dp_shard_dim, tp_dim)
    check_outer_strategy(strategy, outer, dp_outer_dim is not None, "fully_shard")
    for name, value in (
        ("fsdp_group_ag", fsdp_group_ag),
        ("expt_fsdp_group_ag", expt_fsdp_group_ag),
    ):
        if value is not None:
            warn_once(
                f"fsdp.ignored.{name}",
                f"{name} is kept on the FSDPDistributedIndex, but fsdp's all-gathers use the "
                "shard group (no separate all-gather communicator yet)",
            )
    if dp_shard_dim is None and device_mesh.ndim == 1 and device_mesh.mesh_dim_names:
        dp_shard_dim = device_mesh.mesh_dim_names[0]
    dist_index = FSDPDistributedIndex(
        device_mesh,
        dp_shard_dim=dp_shard_dim,
        dp_outer_dim=dp_outer_dim,
        tp_dim=tp_dim,
        hybrid_fsdp_group=hybrid_fsdp_group,
        hsdp_outer_dp_shard=outer is ShardingStrategy.OPTIM,
        expt_device_mesh=expt_device_mesh,
        hybrid_fsdp_expt_group=hybrid_fsdp_expt_group,
        fsdp_group_ag=fsdp_group_ag,
        expt_fsdp_group_ag=expt_fsdp_group_ag,
    )
    policy = mixed_precision_policy or MixedPrecisionPolicy()
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        check_for_nan_in_grad=report_nan_in_param_grad,
        average_in_collective=average_in_collective,
        data_parallel_sharding_strategy=strategy.megatron_name,
        outer_dp_sharding_strategy=outer.megatron_name,
        keep_fp8_transpose_cache=keep_fp8_transpose_cache,
        nccl_ub=nccl_ub,
        fsdp_double_buffer=fsdp_double_buffer,
        fsdp_db_use_persist_buf_on_alloc_fail=fsdp_db_use_persist_buf_on_alloc_fail,
        disable_symmetric_registration=disable_symmetric_registration,
        megatron_fsdp_use_decoupled_grad=use_decoupled_grad,
        # Accepted, ignored (MegatronFSDP warns once; see fsdp_hooks.module.unused_options).
        megatron_fsdp_cuda_graph_mode=cuda_graph_mode,
        megatron_fsdp_enable_fine_grained_param_gather=enable_fine_grained_param_gather,
        megatron_fsdp_max_pool_double_buffer=maxpool_double_buffer,
        megatron_fsdp_main_params_dtype=policy.main_params_dtype,
        megatron_fsdp_main_grads_dtype=policy.main_grads_dtype,
        megatron_fsdp_grad_comm_dtype=policy.grad_comm_dtype,
        suggested_communication_unit_size=suggested_communication_unit_size,
    )
    model = MegatronFSDP(
        module,
        dist_index,
        ddp_config=ddp_config,
        fsdp_unit_modules=fsdp_unit_modules,
        disable_bucketing=disable_bucketing,
        device=device,
        calculate_per_token_loss=calculate_per_token_loss,
        init_model_with_meta_device=init_model_with_meta_device,
        sync_model_each_microbatch=sync_model_each_microbatch,
        keep_fp8_transpose_cache=keep_fp8_transpose_cache,
        nccl_ub=nccl_ub,
        fsdp_double_buffer=fsdp_double_buffer,
        disable_symmetric_registration=disable_symmetric_registration,
        mixed_precision_policy=policy,
        is_expert_param=is_expert_param,
        prefetch_depth=prefetch_depth,
        regather_saved_weights=regather_saved_weights,
        grad_staging=grad_staging,
    )
    # Recorded only (see MegatronFSDP.__init__): the pieces are torch.chunk ones.
    model.preproc_state_dict_for_dcp_ckpt = (
        preproc_state_dict_for_dcp_ckpt and strategy is not ShardingStrategy.NO_SHARD
    )
    _warn_whole_padding(model)
    return model


# Whole placement pads a bucket's shards to its most-loaded owner's matrices; past this
# factor of the bytes it holds, the wrap says so (the same figures on every rank).
_WHOLE_PADDING_WARN = 1.25


def _warn_whole_padding(model: MegatronFSDP) -> None:
    """Warn when whole placement makes the buckets holding whole-placed matrices move
    more than ``_WHOLE_PADDING_WARN`` times their parameters' elements: a bucket with
    fewer matrices than ranks sizes every rank's shard by one whole matrix, so the
    padding grows with the world size (``fsdp-plan --optimizer muon`` shows it before
    launch)."""
    whole = [b.layout for b in model.buffer.buckets if b.layout.has_whole]
    used = sum(layout.used_numel for layout in whole)
    moved = sum(layout.total_numel for layout in whole)
    if used and moved > _WHOLE_PADDING_WARN * used:
        warnings.warn(
            f"fsdp: whole placement (for a whole-matrix optimizer such as Muon) pads the "
            f"shards of {len(whole)} bucket(s) to {moved / used:.2f}x their parameters' "
            "elements: each rank's shard is as large as its most-loaded owner's matrices, "
            "so collectives and sharded buffers grow by that factor. Put more matrices in "
            "a bucket (suggested_communication_unit_size joins consecutive units; at "
            "least as many matrices per bucket as ranks) or shard fewer ranks "
            "(fsdp-plan --optimizer muon predicts it)",
            UserWarning,
            stacklevel=3,
        )


def _check_reads_decoupled_grad(
    optimizer: torch.optim.Optimizer, decoupled: bool, who: str
) -> None:
    """With ``use_decoupled_grad`` the gradients are on ``.decoupled_grad`` only: an
    optimizer that reads ``.grad`` would silently step nothing."""
    if decoupled and not getattr(optimizer, "use_decoupled_grad", False):
        raise ValueError(
            f"{who}: use_decoupled_grad=True puts gradients on .decoupled_grad, but "
            f"{type(optimizer).__name__} reads .grad (it has no use_decoupled_grad=True), "
            "so it would step nothing; use a precision-aware optimizer that reads "
            ".decoupled_grad (e.g. Transformer Engine's FusedAdam(use_decoupled_grad=True)) "
            "or use_decoupled_grad=False"
        )


def _model_of(optimizer: torch.optim.Optimizer) -> MegatronFSDP | None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = getattr(p, "_fsdp_model_ref", None)
            if ref is not None and ref() is not None:
                return ref()
    return None


def fully_shard_optimizer(
    optimizer: torch.optim.Optimizer,
    preproc_state_dict_for_dcp_ckpt: bool = True,
    *,
    model: MegatronFSDP | None = None,
    _step_round: StepRound | None = None,
) -> torch.optim.Optimizer:
    """Make ``optimizer`` step the model's sharded main weights, in place.

    Parameters of the original module are replaced by their DTensor main-weight
    parameters, keeping the param groups. ``step()`` then finishes gradient sync first
    and installs the updated weights after; ``zero_grad()`` also zeros the model's
    gradient buffers. Both accept Megatron-FSDP's extra keywords
    (``sync_grad_before_optimizer_step``, ``install_optimized_model_weights``,
    ``zero_grad_buffer``)."""
    if not optimizer.param_groups or not any(g["params"] for g in optimizer.param_groups):
        raise ValueError(f"the optimizer has no parameters: {optimizer}")
    model = model if model is not None else _model_of(optimizer)
    if model is None:
        raise ValueError(
            "cannot find the fsdp model of this optimizer: build it over the wrapped "
            "model's parameters (model.parameters()) or pass model=..."
        )
    if getattr(optimizer, "_fsdp_model_ref", None) is not None:
        raise ValueError("this optimizer was already passed to fully_shard_optimizer")
    check_optimizer_supported(
        optimizer, model.strategy is not ShardingStrategy.NO_SHARD, "fully_shard_optimizer"
    )
    _check_reads_decoupled_grad(optimizer, model.use_decoupled_grad, "fully_shard_optimizer")
    by_compute = model.hooks.swap.distributed_by_compute
    ours = {id(p) for p in by_compute.values()}
    unknown: list[str] = []
    replaced: dict[nn.Parameter, nn.Parameter | None] = {}
    new_groups = []
    for group in optimizer.param_groups:
        new_params = []
        for p in group["params"]:
            # A WholeParameter steps through its inner tensor (shown again at the end).
            if id(p) in ours:
                new_params.append(inner_of(p))
            elif p in by_compute:
                # frozen (None): nothing to optimize
                target = inner_of(by_compute[p]) if p.requires_grad else None
                replaced[p] = target
                if target is not None:
                    new_params.append(target)
            else:
                unknown.append(f"{type(p).__name__}{tuple(p.shape)}")
        new_groups.append(new_params)
    if unknown:
        raise ValueError(
            f"the optimizer holds {len(unknown)} parameter(s) that are not the wrapped "
            f"module's: {unknown[:5]}; build the optimizer over the module's parameters"
        )
    # State already there (Adagrad makes it in __init__) moves onto the main weights.
    move_state_to_main_weights(optimizer, replaced)
    for group, new_params in zip(optimizer.param_groups, new_groups, strict=True):
        group["params"] = new_params
    # Megatron-FSDP initialises the state here too: a fresh optimizer is then a valid
    # target for dcp.load (see optim_init).
    initial = init_optimizer_state(optimizer)
    # That step restored the weights bit for bit but bumped their version counters: not
    # a user's write to re-install at the next forward.
    model.hooks.params.record_versions()
    patch_optimizer(optimizer, model, initial, _step_round)
    if any(hasattr(p, "_fsdp_whole_owner") for g in optimizer.param_groups for p in g["params"]):
        show_whole_parameters(optimizer)
        register_whole_optimizer_state(optimizer, model.buffer.views)
        # fsdp_ckpt's state initialisation steps the tensors fsdp steps (optim_state).
        optimizer._fsdp_inner_parameters = functools.partial(inner_parameters, optimizer)  # type: ignore[attr-defined]
    if model.experts_differ_across_ranks:
        groups = model.buffer.groups
        is_expert = [
            groups[p._fsdp_group_index[0]].is_expert_param
            for group in optimizer.param_groups
            for p in group["params"]
        ]
        refuse_positional_expert_state_in_dcp(optimizer, is_expert)
    return optimizer


def fully_shard(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    *args: Any,
    **kwargs: Any,
) -> tuple[MegatronFSDP, Any]:
    """``fully_shard_model(module, ...)`` then ``fully_shard_optimizer`` on an optimizer
    built over ``module``'s parameters (or on each of a list of optimizers over disjoint
    parameters: see the module note); returns ``(model, optimizer)`` (the list, for a
    list). Arguments after the optimizer are ``fully_shard_model``'s, positionally in
    megatron_fsdp's order (``device_mesh``, ``dp_shard_dim``, ``dp_outer_dim``,
    ``tp_dim``, ...) or by name."""
    names = _MODEL_ARGUMENTS
    if len(args) > len(names):
        raise TypeError(
            f"fully_shard() takes at most {len(names) + 2} positional arguments (module, "
            f"optimizer, then {', '.join(names[:3])}, ...) but {len(args) + 2} were given"
        )
    for name, value in zip(names[: len(args)], args, strict=True):
        if name in kwargs:
            raise TypeError(f"fully_shard() got multiple values for argument {name!r}")
        kwargs[name] = value
    preproc = kwargs.get("preproc_state_dict_for_dcp_ckpt", True)
    many = isinstance(optimizer, (list, tuple))
    optimizers = list(optimizer) if many else [optimizer]
    if many and not optimizers:
        raise ValueError("fully_shard: the list of optimizers is empty")
    # Before anything is sharded: a refused optimizer leaves the module untouched.
    check_argument_types("fully_shard", module, kwargs.get("fsdp_unit_modules"))
    check_option_types("fully_shard", fully_shard_model, kwargs)  # read below before the wrap
    strategy = ShardingStrategy.parse(kwargs.get("zero_dp_strategy", 3))
    sharded = strategy is not ShardingStrategy.NO_SHARD
    seen: dict[int, int] = {}
    for j, opt in enumerate(optimizers):
        check_optimizer_supported(opt, sharded=False)
        _check_reads_decoupled_grad(opt, bool(kwargs.get("use_decoupled_grad")), "fully_shard")
        for group in opt.param_groups:
            for p in group["params"]:
                if seen.setdefault(id(p), j) != j:
                    raise ValueError(
                        f"fully_shard: a parameter of shape {tuple(p.shape)} is in optimizers "
                        f"{seen[id(p)]} and {j}; each parameter may be stepped by one only"
                    )
    if sharded:
        for opt in optimizers:
            mark_whole_placement(opt)
    model = fully_shard_model(module, **kwargs)
    step_round = StepRound(len(optimizers)) if many else None
    if step_round is not None:
        model.register_forward_pre_hook(step_round.check_complete)
    wrapped = [
        fully_shard_optimizer(opt, preproc, model=model, _step_round=step_round)
        for opt in optimizers
    ]
    return model, (wrapped if many else wrapped[0])


# fully_shard_model's parameters after ``module``, in order (megatron_fsdp's, then
# fsdp's own ``is_expert_param``).
_MODEL_ARGUMENTS = tuple(inspect.signature(fully_shard_model).parameters)[1:]
