"""``FullyShardedDataParallel``: the Megatron-Core style entry point to ``MegatronFSDP``.

Megatron-Core builds its models as ``FullyShardedDataParallel(config, ddp_config,
module)``; this adapter takes the same arguments, validates them as Megatron-FSDP does
(``fsdp_checks.py``), builds the ``FSDPDistributedIndex`` over the whole world unless
one is given, and wraps ``module`` in ``MegatronFSDP`` as ``self.module`` (so the
original module is ``model.module.module``, as in Megatron-Core).

The optimizer contract is ``fully_shard``'s: ``model.parameters()`` are DTensors holding
this rank's shard of the main weights, with ``.grad`` on the main-grad shard. Step them
with any torch optimizer made by ``fully_shard_optimizer(optimizer)`` (which finishes
gradient sync before the step and installs the new weights after), or call
``finalize_model_grads([model])``, ``optimizer.step()`` and
``model.install_optimized_model_weights()`` yourself, as Megatron-Core's training loop
does.

Gradient reduction follows ``MegatronFSDP``'s default: replicated gradients
(``no_shard``, ``optim``) are reduced by ``finish_grad_sync`` (which
``finalize_model_grads`` calls); sharded ones are reduce-scattered during backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_buffers import GradStaging, MixedPrecisionPolicy, ShardingStrategy
from fsdp_hooks.integrations.megatron_core._common import (
    coerce_ddp_config,
    dist_index_over,
    hybrid_dist_index,
    index_from_pg_collection,
    set_is_first_microbatch,
    transformer_option,
)
from fsdp_hooks.integrations.megatron_core.fsdp_checks import check_fsdp_config
from fsdp_hooks.integrations.megatron_core.fsdp_sharded_state import dtensor_sharded_state_dict
from fsdp_hooks.integrations.megatron_core.tp_detection import (
    MODULE_TYPE_REGISTRY,
    annotate_tensor_parallelism,
    detect_parallelism_type,
)
from fsdp_hooks.module.inner_module import InnerModuleAttributes
from fsdp_hooks.module.megatron_fsdp import MegatronFSDP
from fsdp_hooks.setup.validation import check_option_types
from fsdp_mesh import FSDPDistributedIndex

__all__ = ["FullyShardedDataParallel"]

# Megatron-Core's default FSDP unit under optim_grads_params, found by class name so
# that Megatron-Core itself need not be installed.
_DEFAULT_UNIT_CLASS_NAME = "TransformerLayer"


def _default_units(module: nn.Module, strategy: ShardingStrategy) -> list[type[nn.Module]]:
    if strategy is not ShardingStrategy.OPTIM_GRADS_PARAMS:
        return []
    found = {type(m) for m in module.modules() if type(m).__name__ == _DEFAULT_UNIT_CLASS_NAME}
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__qualname__}")


def _check_given_index(dist_index: FSDPDistributedIndex, instances: int) -> None:
    outer = dist_index.outer_size if dist_index.use_hybrid_fsdp else 1
    if instances > 1 and outer != instances:
        raise ValueError(
            "FullyShardedDataParallel: ddp_config.num_distributed_optimizer_instances="
            f"{instances} but dist_index has {outer} outer (replica) ranks; they must agree "
            "(an index with dp_outer_dim of that size, or num_distributed_optimizer_instances=1)"
        )


class FullyShardedDataParallel(InnerModuleAttributes):
    """Megatron-Core's ``FullyShardedDataParallel(config, ddp_config, module, ...)``.

    Args:
        config: a transformer config (any object, or None). Read:
            ``calculate_per_token_loss`` (sum gradients instead of averaging them),
            ``init_model_with_meta_device`` (materialize a meta-device model shard by
            shard); both default to False; and ``num_moe_experts``: when set, the index
            built here has an expert mesh (over ``pg_collection.expt_dp`` when given,
            else the data-parallel ranks: expert parallelism of one rank).
        ddp_config: ``DistributedDataParallelConfig`` (fsdp's or Megatron-Core's), a
            dict of its fields, or None. ``data_parallel_sharding_strategy`` picks the
            strategy ('no_shard', 'optim', 'optim_grads', 'optim_grads_params').
            ``num_distributed_optimizer_instances`` > 1 is hybrid sharding over the
            world: that many replicas of a shard group of consecutive ranks, gradients
            all-reduced across them (``outer_dp_sharding_strategy='no_shard'``) or main
            weights and optimizer state sharded across them too ('optim').
        module: the model to wrap.
        fsdp_unit_modules: classes (or dotted class paths) whose instances are gathered
            and released as a unit. Default: classes named ``TransformerLayer`` under
            'optim_grads_params' (Megatron-Core's), none otherwise.
        disable_bucketing: one bucket for the parameters outside FSDP units.
        device: the compute device; default: the mesh's (this rank's GPU, or CPU).
        pg_collection: Megatron-Core's ProcessGroupCollection; its ``dp_cp`` group is
            the data-parallel group. Other parallel groups must have one rank.
        dist_index: an ``FSDPDistributedIndex`` to use instead of building one (its
            outer dim, if any, must have ``num_distributed_optimizer_instances`` ranks).
        mixed_precision_policy: overrides the ``megatron_fsdp_*_dtype`` fields.

    Before wrapping, parameters of module classes Megatron-Core knows get their
    tensor-parallel mode (``_MODULE_TYPE_REGISTRY``, ``tp_detection``), as Megatron-Core's
    adapter does.
    """

    # Megatron-Core's names; a subclass may extend the registry.
    _MODULE_TYPE_REGISTRY: dict[str, set[str]] = MODULE_TYPE_REGISTRY

    def __init__(
        self,
        config: object,
        ddp_config: object,
        module: nn.Module,
        fsdp_unit_modules: Iterable[type[nn.Module] | str] | None = None,
        disable_bucketing: bool = False,
        device: torch.device | str | None = None,
        pg_collection: Any = None,
        *,
        dist_index: FSDPDistributedIndex | None = None,
        mixed_precision_policy: MixedPrecisionPolicy | None = None,
    ) -> None:
        super().__init__()
        who = "FullyShardedDataParallel"
        check_option_types(  # Note [option types]
            who,
            FullyShardedDataParallel.__init__,
            {"disable_bucketing": disable_bucketing, "device": device},
        )
        cfg = coerce_ddp_config(ddp_config, who)
        if not isinstance(module, nn.Module):
            raise TypeError(f"{who}: module must be an nn.Module; got {type(module).__name__}")
        meta_init = bool(transformer_option(config, "init_model_with_meta_device"))
        # A MoE config: the index gets an expert mesh, as Megatron-Core's adapter builds.
        moe = transformer_option(config, "num_moe_experts") is not None
        strategy = check_fsdp_config(cfg, meta_init)
        cfg.data_parallel_sharding_strategy = strategy.megatron_name
        instances = cfg.num_distributed_optimizer_instances
        outer_optim = ShardingStrategy.parse(cfg.outer_dp_sharding_strategy) is (
            ShardingStrategy.OPTIM
        )
        if dist_index is not None:
            _check_given_index(dist_index, instances)
        elif instances > 1 and pg_collection is not None:
            raise NotImplementedError(
                f"{who}: num_distributed_optimizer_instances={instances} together with "
                "pg_collection is not implemented yet; pass dist_index (an "
                "FSDPDistributedIndex with dp_outer_dim) or no pg_collection (the world, "
                f"as {instances} replicas of consecutive-rank shard groups)"
            )
        elif instances > 1:
            dist_index = hybrid_dist_index(instances, outer_optim, who, experts=moe)
        elif pg_collection is not None:
            dist_index = index_from_pg_collection(pg_collection, who, experts=moe)
        else:
            dist_index = dist_index_over(None, who, experts=moe)
        units = (
            list(fsdp_unit_modules)
            if fsdp_unit_modules is not None
            else _default_units(module, strategy)
        )
        self._annotate_tensor_parallelism(module)
        self.config = config
        self.ddp_config = cfg
        self.megatron_fsdp_dist_index = dist_index
        self.fsdp_unit_modules = units
        self.module = MegatronFSDP(
            module,
            dist_index,
            ddp_config=cfg,
            fsdp_unit_modules=units,
            disable_bucketing=disable_bucketing,
            device=torch.device(device) if device is not None else None,
            calculate_per_token_loss=bool(transformer_option(config, "calculate_per_token_loss")),
            init_model_with_meta_device=meta_init,
            mixed_precision_policy=mixed_precision_policy,
            # Megatron-Core's layers add into param.main_grad themselves (fused wgrad).
            grad_staging=GradStaging.MAIN_GRAD,
        )
        # Megatron-Core's DistributedOptimizer (use_megatron_fsdp) reads
        # parameter_groups and calls copy_main_weights_to_model_weights() on it.
        self.param_and_grad_buffer = self.module.param_and_grad_buffer

    # ---- tensor-parallel detection (Megatron-Core's methods) -------------------------------
    def _detect_parallelism_type(self, param_name: str, module: nn.Module) -> str | None:
        """``"column"``, ``"row"``, ``"replicated"`` or None (``tp_detection``)."""
        return detect_parallelism_type(param_name, module, self._MODULE_TYPE_REGISTRY)

    def _annotate_tensor_parallelism(self, root_module: nn.Module) -> None:
        """``_tensor_parallel_mode`` on every parameter whose module class tells it."""
        annotate_tensor_parallelism(root_module, self._MODULE_TYPE_REGISTRY)

    # ---- forward ------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    @property
    def dist_index(self) -> FSDPDistributedIndex:
        return self.megatron_fsdp_dist_index

    # ---- gradient and parameter sync (Megatron-Core's _BaseDataParallel methods) ---------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside do not reduce replicated gradients (they accumulate)."""
        with self.module.no_sync():
            yield

    def start_grad_sync(self, *unused: Any) -> None:
        self.module.start_grad_sync()

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """Reduce what is still unreduced, wait, check NaN/Inf when asked, and attach the
        main-grad shards to the parameters. ``force_all_reduce`` (Megatron-Core's
        ``finalize_model_grads`` passes it) has no effect, as in Megatron-Core's
        FSDP adapter."""
        self.module.finish_grad_sync(force_all_reduce=force_all_reduce)

    def start_param_sync(self, *unused: Any, force_sync: bool = False) -> None:
        self.module.start_param_sync(force_sync=force_sync)

    def scale_gradients(self, scaling_factor: float) -> None:
        self.module.scale_gradients(scaling_factor)

    def zero_grad_buffer(self) -> None:
        self.module.zero_grad_buffer()

    def broadcast_params(self) -> None:
        self.module.broadcast_params()

    def install_optimized_model_weights(self) -> None:
        self.module.install_optimized_model_weights()

    def stop_communication(self) -> None:
        self.module.synchronize_gradient_reduce()
        self.module.synchronize_param_gather()

    def sync_rng_states_across_tp_group(self) -> None:
        """Give every tensor-parallel rank tp rank 0's default RNG state of the compute
        device (Megatron-FSDP's method), so that draws outside a tracker fork agree
        across tp; a no-op without a tp group of more than one rank."""
        index = self.dist_index
        if index.tp_group is None or index.tp_size <= 1:
            return
        cuda = self.module.device.type == "cuda"
        state = [torch.cuda.get_rng_state() if cuda else torch.get_rng_state()]
        dist.broadcast_object_list(state, group=index.tp_group, group_src=0)
        if cuda:
            torch.cuda.set_rng_state(state[0])
        else:
            torch.set_rng_state(state[0])

    def comm_stats(self, reset: bool = False) -> dict[str, dict[str, float]]:
        return self.module.comm_stats(reset=reset)

    def set_is_first_microbatch(self) -> None:
        """Megatron-Core's: with a quantizing transformer config (fp8, fp4, kitchen or a
        quant recipe), flag every submodule that has ``is_first_microbatch``."""
        set_is_first_microbatch(self, self.config)

    # ---- state dicts -------------------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict under its own names (DTensor shards)."""
        return self.module.state_dict(*args, **kwargs)

    def state_dict_for_save_checkpoint(
        self, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def sharded_state_dict(self, prefix: str = "", *args: Any, **kwargs: Any) -> Any:
        """Megatron-Core's dist-checkpointing state dict (``dist_checkpointing.save`` /
        ``load``): the wrapped Megatron-Core module's own ``sharded_state_dict`` (its keys,
        tensor-parallel and layer offsets), with each DTensor parameter described by this
        rank's ``torch.chunk`` piece; after ``dist_checkpointing.load`` the pieces come
        back as DTensors, for ``load_state_dict``."""
        inner_module = self.module.module
        inner = getattr(inner_module, "sharded_state_dict", None)
        if not callable(inner):
            raise AttributeError(
                "FullyShardedDataParallel: the wrapped "
                f"{type(inner_module).__name__} has no "
                "sharded_state_dict(); it is a Megatron-Core MegatronModule method (save "
                "state_dict(), DTensors, with torch.distributed.checkpoint otherwise)"
            )
        return dtensor_sharded_state_dict(inner(prefix, *args, **kwargs))
