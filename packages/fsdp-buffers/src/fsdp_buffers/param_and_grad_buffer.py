"""``ParamAndGradBuffer``: every bucket of a module, as the sharding strategy asks.

For each ``ParameterGroup`` it builds one ``Bucket`` (``bucket.py``), which owns the
group's buffers, state and collectives. Up to three ``DataParallelBuffer``s over one
shared ``FlatLayout``, so that the same element index means the same value in each:

| buffer        | dtype                  | sharded when                              |
|---------------|------------------------|-------------------------------------------|
| model weight  | the parameters' dtype  | ``optim_grads_params`` (3)                |
| main weight   | ``main_params_dtype``  | ``optim`` (1) and above                   |
| main grad     | ``main_grads_dtype``   | ``optim_grads`` (2) and above             |

A ``fsdp_no_shard`` group, and any group when the shard group has one rank, keeps all
three replicated and all-reduces its gradients. When the main-weight dtype equals the
parameters' dtype there is no separate main-weight buffer: the main weights are the
model-weight buffer's local shard (a slice of it when it is replicated), so fp32
training keeps one copy of the weights, not two.

What is left here is construction and indexes (parameter -> bucket, name -> bucket,
unit -> buckets, root buckets) and the loops over every bucket (install, broadcast,
zero, scale). The DTensor face for optimizers and checkpoints is ``views``
(``DTensorViews``); tensor parallelism is ``tp`` (``TensorParallel``); the outer dim of
hybrid sharding is each bucket's ``outer`` (``OuterSharding``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator

import torch
from torch import nn

from fsdp_buffers.bucket import Bucket, BucketContext, CommGroup, GradState
from fsdp_buffers.bucket_state import GradConfig, GradStaging
from fsdp_buffers.collectives import CommContext, CommStats, PendingCollective, read_timeout_env
from fsdp_buffers.data_parallel_buffer import (
    BucketAllocator,
    DoubleBufferAllocator,
    TemporaryBucketAllocator,
)
from fsdp_buffers.dtensor_views import DTensorViews
from fsdp_buffers.hybrid_sharding import hybrid_mesh
from fsdp_buffers.layout import DEFAULT_ALIGNMENT
from fsdp_buffers.mixed_precision import MixedPrecisionPolicy
from fsdp_buffers.param_group import (
    UnitSpec,
    group_parameters,
    resolve_unit_classes,
)
from fsdp_buffers.profiling import annotate
from fsdp_buffers.strategy import ShardingStrategy
from fsdp_buffers.tensor_parallel import TensorParallel
from fsdp_mesh import current_device

__all__ = ["ParamAndGradBuffer"]


class ParamAndGradBuffer:
    """The buckets of every parameter group of ``module`` and their indexes."""

    def __init__(
        self,
        module: nn.Module,
        dist_index,  # fsdp_mesh.FSDPDistributedIndex
        *,
        strategy: ShardingStrategy | int | str = ShardingStrategy.OPTIM_GRADS_PARAMS,
        mixed_precision_policy: MixedPrecisionPolicy | None = None,
        fsdp_unit_modules: Iterable[UnitSpec] | None = None,
        bucket_size: int | None = None,
        disable_bucketing: bool = False,
        device: torch.device | str | None = None,
        fsdp_double_buffer: bool = False,
        gradient_scaling_factor: float | None = None,
        expert_gradient_scaling_factor: float | None = None,
        average_in_collective: bool = False,
        is_expert_param: Callable[[str, nn.Parameter], bool] | None = None,
        alignment: int = DEFAULT_ALIGNMENT,
        allow_meta: bool = False,
        tensor_parallel: TensorParallel | None = None,
        communication_unit_size: int | None = None,
        communication_unit_max_units: int | None = None,
        grad_staging: GradStaging | str = GradStaging.AUTOGRAD,
    ) -> None:
        read_timeout_env()  # FSDP_COLLECTIVE_TIMEOUT_S as it is at wrap time
        self.module = module
        self.dist_index = dist_index
        self.strategy = ShardingStrategy.parse(strategy)
        if dist_index.hsdp_outer_dp_shard and self.strategy is not (
            ShardingStrategy.OPTIM_GRADS_PARAMS
        ):
            raise ValueError(
                "ParamAndGradBuffer: fully-sharded hybrid sharding (hsdp_outer_dp_shard=True, "
                "outer strategy 'optim') requires strategy 'optim_grads_params'; got "
                f"{self.strategy.megatron_name!r}."
            )
        self.average_in_collective = average_in_collective
        self.device = _check_devices(module, device, allow_meta)
        self._ctx = BucketContext(
            policy=mixed_precision_policy or MixedPrecisionPolicy(),
            stats=CommStats(),
            device=self.device,
            average_in_collective=average_in_collective,
            scratch=TemporaryBucketAllocator(),
            grads=GradConfig(GradStaging.parse(grad_staging)),
            comm=CommContext(self.device),
        )
        # The profiler ranges of the calls made every step, made once (re-entrant).
        self._range_install = annotate("fsdp.install_optimized_model_weights")
        self._range_zero_grad = annotate("fsdp.zero_grad_buffer")
        # The wrapper classifies the parameters for tp once, at its checks, and passes it.
        self.tp = (
            tensor_parallel if tensor_parallel is not None else TensorParallel(module, dist_index)
        )
        unit_classes = resolve_unit_classes(fsdp_unit_modules, module)
        self.groups, self.unit_names = group_parameters(
            module,
            unit_classes,
            bucket_size=bucket_size,
            disable_bucketing=disable_bucketing,
            is_expert_param=is_expert_param,
            communication_unit_size=communication_unit_size,
            communication_unit_max_units=communication_unit_max_units,
        )
        self.policy = self._ctx.policy  # resolves the groups' gradient communication dtypes
        self.communication_unit_size = communication_unit_size
        self.communication_unit_max_units = communication_unit_max_units
        self.gradient_scaling_factor = (
            1.0 / dist_index.dp_size if gradient_scaling_factor is None else gradient_scaling_factor
        )
        # Experts too are scaled by 1/(dense data-parallel size), as Megatron-Core does:
        # an expert's local gradient already sums the tokens of every expert-parallel
        # rank (through the token exchange), so summing it over the expert data-parallel
        # ranks counts every rank's loss once, and the mean is over all of them.
        self.expert_gradient_scaling_factor = (
            1.0 / dist_index.dp_size
            if expert_gradient_scaling_factor is None
            else expert_gradient_scaling_factor
        )
        self.allocator: BucketAllocator = (
            DoubleBufferAllocator(self.device) if fsdp_double_buffer else self._ctx.scratch
        )
        self.param_index: dict[nn.Parameter, tuple[int, int]] = {
            p: (gid, i) for gid, group in enumerate(self.groups) for i, p in enumerate(group.params)
        }
        # The same by id (``group_of``, once per gradient: a Tensor hashes in Python).
        # ``param_index`` keeps the parameters alive, so an id matches only its own.
        self._index_by_id = {id(p): (p, at) for p, at in self.param_index.items()}
        self.root_groups: list[int] = self._root_groups()
        self.buckets: list[Bucket] = []
        # Each bucket's parameters become views into its buffers as soon as they are
        # built, so that the group's original tensors are freed before the next group's
        # buffers are allocated (wrapping then holds the model plus one group, not the
        # model twice, and the allocator can reuse the freed memory). Views last with a
        # DoubleBufferAllocator: it sizes its slots once all are registered.
        views_early = not isinstance(self.allocator, DoubleBufferAllocator)
        comms = {e: self._comm_groups(e) for e in {g.is_expert_param for g in self.groups}}
        # Units take turns in the double buffer's two slots in the order they are built.
        slot_keys: dict[int | None, int] = {}
        for gid, group in enumerate(self.groups):
            shard, shard_mesh, outer = comms[group.is_expert_param]
            bucket = Bucket(
                gid,
                group,
                self._ctx,
                strategy=self.strategy,
                shard=shard,
                shard_mesh=shard_mesh,
                outer=outer,
                outer_shards_main_weights=dist_index.hsdp_outer_dp_shard,
                tp=self.tp,
                grad_scale=(
                    self.expert_gradient_scaling_factor
                    if group.is_expert_param
                    else self.gradient_scaling_factor
                ),
                alignment=alignment,
                allocator=self.allocator,
                is_root=gid in self.root_groups,
                slot_keys=slot_keys,
                load=not allow_meta,
            )
            self.buckets.append(bucket)
            if views_early:
                bucket.point_params_at_buffers()
        if not views_early:
            for bucket in self.buckets:
                bucket.point_params_at_buffers()
        self._set_optimizer_meshes()
        self.views = DTensorViews(self)

    # ---- construction -------------------------------------------------------------
    def _comm_groups(self, expert: bool) -> tuple[CommGroup, object, CommGroup | None]:
        """The shard group, its mesh and the outer group (None unless hybrid with more
        than one outer rank) of dense or expert buckets, resolved once."""
        idx = self.dist_index
        shard = CommGroup(
            idx.get_fsdp_group(is_expert_parallel=expert),
            idx.expt_fsdp_size if expert else idx.fsdp_size,
            idx.expt_fsdp_rank if expert else idx.fsdp_rank,
        )
        mesh = (
            idx.get_submesh(idx.dp_shard_dim, is_expert_parallel=True) if expert else idx.fsdp_mesh
        )
        outer = None
        if idx.use_hybrid_fsdp:
            size = idx.expt_outer_size if expert else idx.outer_size
            if size > 1:
                outer = CommGroup(
                    idx.get_outer_fsdp_group(is_expert_parallel=expert),
                    size,
                    idx.expt_outer_rank if expert else idx.outer_rank,
                )
        return shard, mesh, outer

    def _set_optimizer_meshes(self) -> None:
        """Fully-sharded hybrid main weights live on the hybrid mesh; so, in that mode,
        do trainable buckets replicated everywhere (``fsdp_no_shard``, 0-d), so that
        every optimizer DTensor shares one mesh (``clip_grad_norm_`` cannot mix meshes)."""
        meshes = {
            e: hybrid_mesh(self.dist_index, e)
            for e in sorted({b.group.is_expert_param for b in self.buckets if b.outer_sharded})
        }
        for b in self.buckets:
            mesh = meshes.get(b.group.is_expert_param)
            replicated = b.group.requires_grad and not b.sharding.main_weights
            if mesh is not None and (b.outer_sharded or replicated):
                b.optimizer_mesh = mesh

    def _root_groups(self) -> list[int]:
        """Buckets gathered for the whole step: those outside every unit, and unit
        buckets holding a parameter that a module outside every unit also owns (weight
        tying, e.g. an output head tied to an embedding unit), as no unit's hooks run
        around that module."""
        found = set(self.groups_of_unit(None))
        units = self.unit_names
        for name, sub in self.module.named_modules():
            if any(u == "" or name == u or name.startswith(u + ".") for u in units):
                continue
            for p in sub._parameters.values():
                if p is not None and p in self.param_index:
                    found.add(self.param_index[p][0])
        return sorted(found)

    # ---- indexes -------------------------------------------------------------------
    @property
    def policy(self) -> MixedPrecisionPolicy:
        return self._ctx.policy

    @policy.setter
    def policy(self, policy: MixedPrecisionPolicy) -> None:
        self._ctx.grad_comm_dtypes = {
            g.dtype: policy.grad_comm_dtype_for(g.dtype)
            for g in self.groups
            if g.requires_grad and g.is_float
        }
        self._ctx.policy = policy

    @property
    def stats(self) -> CommStats:
        return self._ctx.stats

    @property
    def comm(self) -> CommContext:
        """The streams every bucket's collectives run on (Note [streams and frees])."""
        return self._ctx.comm

    @comm.setter
    def comm(self, comm: CommContext) -> None:
        # Another context (a test's recorder) only between steps: a collective launched
        # under the old one would be waited on under the new one.
        busy = [b.gid for b in self.buckets if b.gather_in_flight]
        if busy:
            raise RuntimeError(
                f"cannot replace the communication context while the gathers of buckets "
                f"{busy} are in flight; wait for them (or release the buckets) first"
            )
        self._ctx.comm = comm

    def group_of(self, param: nn.Parameter) -> tuple[int, int]:
        entry = self._index_by_id.get(id(param))
        if entry is not None and entry[0] is param:
            return entry[1]
        try:
            return self.param_index[param]
        except KeyError:
            raise KeyError(
                "parameter is not managed by this ParamAndGradBuffer (was it replaced "
                "after wrapping?)"
            ) from None

    def named_params(self) -> Iterator[tuple[str, int, int, nn.Parameter]]:
        for gid, group in enumerate(self.groups):
            for i, (name, p) in enumerate(zip(group.names, group.params, strict=True)):
                yield name, gid, i, p

    @property
    def num_buckets(self) -> int:
        return len(self.groups)

    def groups_of_unit(self, unit_id: int | None) -> list[int]:
        """Buckets whose ``fsdp_unit_id`` is ``unit_id``: with unit coalescing, those of
        the communication unit that ``unit_id`` opens (none for the units joined to it)."""
        return [g for g, grp in enumerate(self.groups) if grp.fsdp_unit_id == unit_id]

    # ---- every bucket --------------------------------------------------------------
    def install_optimized_model_weights(self, stale: Collection[int] = ()) -> None:
        """Copy the optimizer's main weights into the compute weights; where compute
        weights are replicated but main weights sharded (strategies 1 and 2), all-gather
        them so that every rank has the whole updated model. Buckets in ``stale`` are
        marked STALE instead (``Bucket.mark_stale``, only where ``can_be_stale``): the
        next gather of each (``AllGatherPipeline``) is its all-gather."""
        pending: list[PendingCollective] = []
        with torch.no_grad(), self._range_install:
            for bucket in self.buckets:
                if bucket.gid in stale and bucket.can_be_stale:
                    bucket.mark_stale()
                    continue
                started = bucket.start_install()
                if started is None:
                    continue
                pending.append(started)
                # Each gather holds a rank-major copy of its bucket until unpacked: at
                # most two in flight, not the whole model's worth.
                if len(pending) > 1:
                    pending.pop(0).wait()
        for p in pending:
            p.wait()

    def broadcast_params(self, src_group_rank: int = 0) -> None:
        """Make every replicated buffer equal to that of shard-group rank
        ``src_group_rank``; sharded main weights are then re-derived from the model
        weights they shadow, so all ranks hold one consistent model (a STALE bucket is
        installed first)."""
        with torch.no_grad(), annotate("fsdp.broadcast_params"):
            for bucket in self.buckets:
                bucket.broadcast(src_group_rank)

    @property
    def grad_staging(self) -> GradStaging:
        """Where gradients wait for their reduction (Note [gradient staging])."""
        return self._ctx.grads.staging

    def grad_states(self) -> list[GradState]:
        return [b.grads.state for b in self.buckets]

    def scale_gradients(self, scaling_factor: float) -> None:
        with torch.no_grad():
            for bucket in self.buckets:
                bucket.grads.scale_grads(scaling_factor)

    def zero_grad_buffer(self) -> None:
        """Zero every bucket's gradients. Sharded ones are released instead (Note
        [released gradients] in ``bucket_grads``) unless an optimizer parameter still holds
        them as its ``.grad`` (e.g. after ``zero_grad(set_to_none=False)``: as in torch,
        that gradient stays allocated, zeroed)."""
        views = self.views
        with torch.no_grad(), self._range_zero_grad:
            for bucket in self.buckets:
                if bucket.grads.zero_grads(release=not views.grads_in_use(bucket.gid)):
                    views.park_grads(bucket.gid)

    def persistent_bytes(self) -> int:
        """Bytes held by persistent buffers on this rank (not fetched buckets)."""
        return sum(b.persistent_bytes() for b in self.buckets)


def _check_devices(
    module: nn.Module, device: torch.device | str | None, allow_meta: bool
) -> torch.device:
    devices = {p.device for p in module.parameters()}
    if any(d.type == "meta" for d in devices) and not allow_meta:
        names = [n for n, p in module.named_parameters() if p.device.type == "meta"][:5]
        raise ValueError(
            f"parameters {names} are on the meta device; materialize the model first, or "
            f"ask for meta-device initialization (init_model_with_meta_device=True)"
        )
    real = {d for d in devices if d.type != "meta"}
    if len(real) > 1:
        by_device: dict[str, list[str]] = {}
        for n, p in module.named_parameters():
            by_device.setdefault(str(p.device), []).append(n)
        summary = {d: names[:3] for d, names in by_device.items()}
        raise ValueError(
            f"parameters are on different devices {sorted(map(str, real))} (e.g. {summary}); "
            f"move the module to one device before wrapping"
        )
    if device is not None:
        target = torch.device(device)
        held = next(iter(real)) if real else target
        # "cuda" and "cuda:0" may name one device; two explicit indices must agree.
        differ = held.type != target.type or (
            held.index is not None and target.index is not None and held.index != target.index
        )
        if differ:
            raise ValueError(
                f"parameters are on {next(iter(real))} but device={target} was requested; "
                f"move the module there first"
            )
        return target
    if real:
        return next(iter(real))
    return current_device()  # all on meta, no device given: the process's default
