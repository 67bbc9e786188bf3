"""``DTensorViews``: the DTensor face of a ``ParamAndGradBuffer`` (``buffer.views``).

Every original parameter gets a DTensor over this rank's part of its storage, with no
communication: the optimizer's parameters are the main weights (``Shard(0)`` when the
optimizer state is sharded, ``Replicate()`` when not), whose ``.grad`` is a DTensor over
the main-grad rows; frozen and integer parameters are views of the model weights.
In-place updates on them land in the buffers.

Every sharded local tensor is the ``torch.chunk`` piece DTensor's ``Shard(0)`` says it is
(Note [shard layout] in ``layout``), so every DTensor op, ``full_tensor()``,
``redistribute`` and DCP are right on them. 0-d parameters are ``Replicate()``. Sharded
DTensors also carry ``_fsdp_row_partition`` (rows per rank; the same chunks) for the
checkpoint layer, which reads it where a DTensor comes without one (FSDP2's).

Hybrid sharding: with the outer dim replicating, the DTensors are the same as without
it, on the shard mesh (each outer replica is one consistent DTensor world; DCP writes
a chunk once, whichever replica offers it). Fully-sharded hybrid main weights (and their
grads and optimizer state) are ``Shard(0)`` on the 1-D mesh over the hybrid group
(``Bucket.optimizer_mesh``), coordinate f holding piece f of shard x outer:
``clip_grad_norm_`` then reduces the norm over every data-parallel rank, each holding a
disjoint chunk.

Whole placement (Note [whole placement] in ``layout``): a parameter one rank owns whole
has no honest DTensor (its pieces are not ``torch.chunk``'s, and a ``Replicate`` would
claim every rank holds it). The tensor fsdp steps (``optimizer_named_parameters``) is a
plain ``nn.Parameter``: on the owner, the whole matrix in the main weights (``.grad`` the
whole main grad), so a whole-matrix optimizer steps it exactly; elsewhere a placeholder on
the meta device with the parameter's shape and ``.grad`` always None, so every optimizer
skips it. Both carry ``_fsdp_whole_owner`` (the owner's rank in the shard group) and
``_fsdp_guard``: the ``WholeParameter`` (``whole_param``) that the model and the
optimizer's param groups show instead, alike on every rank
(``distributed_named_parameters``). ``full_parameter`` broadcasts from the owner; the
``whole_*`` methods give state dicts the row placement's DTensors.

Tensor parallelism: the views live on the 2-D mesh (dp_shard, tp) and carry
``_fsdp_tp_partition`` too; see Note [tensor parallelism] in ``tensor_parallel``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_buffers import collectives
from fsdp_buffers.bucket import Bucket
from fsdp_buffers.data_parallel_buffer import DataParallelBuffer
from fsdp_buffers.tensor_parallel import TensorParallel
from fsdp_buffers.whole_param import WholeParameter

__all__ = ["DTensorViews", "ViewedBuffer"]


class ViewedBuffer(Protocol):
    """What ``DTensorViews`` reads of its buffer (a ``ParamAndGradBuffer``, which owns
    the views and so is above this module): its buckets, its tensor parallelism, its
    ``FSDPDistributedIndex`` and its parameters in order."""

    buckets: list[Bucket]
    tp: TensorParallel
    dist_index: Any  # fsdp_mesh.FSDPDistributedIndex

    def named_params(self) -> Iterator[tuple[str, int, int, nn.Parameter]]:
        """(name, bucket, position in the bucket, parameter) of every parameter."""
        ...


class DTensorViews:
    """DTensor views of one buffer's parameters, made once and cached."""

    def __init__(self, buffer: ViewedBuffer) -> None:
        self._buffer = buffer
        self._optimizer_params: list[tuple[str, nn.Parameter]] | None = None
        self._distributed_params: list[tuple[str, nn.Parameter]] | None = None
        self._name_index: dict[str, tuple[int, int]] | None = None
        # (bucket, index) -> the gradient DTensor and where it points (Note [released
        # gradients] in ``bucket``).
        self._grad_cache: dict[tuple[int, int], _GradView] = {}
        self._params_of: dict[int, list[tuple[int, nn.Parameter]]] = {}  # by bucket
        self._zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        # Where the optimizer's gradients go: ``.grad`` (cast to the main weights' dtype),
        # or, with Megatron-FSDP's ``use_decoupled_grad``, ``.decoupled_grad`` in the main
        # grads' own dtype (for precision-aware optimizers) with ``.grad`` left None.
        self.grad_attr = "grad"

    def _view(self, b: Bucket, index: int, local: torch.Tensor, placement, mesh) -> DTensor:
        local = storage_from_start(local)  # Note [picklable views]
        return self._buffer.tp.view_dtensor(b.group.params[index], local, placement, mesh)

    @staticmethod
    def _is_sharded_slot(b: Bucket, index: int, sharded: bool) -> bool:
        """Whether parameter ``index`` of a bucket whose storage is ``sharded`` is split
        (0-d parameters are whole on every rank)."""
        return sharded and not b.layout.slots[index].replicated

    def _dtensor(self, b: Bucket, index: int, local: torch.Tensor) -> DTensor:
        split = self._is_sharded_slot(b, index, b.sharding.main_weights)
        placement = Shard(0) if split else Replicate()
        return self._view(b, index, local, placement, b.optimizer_mesh)

    @staticmethod
    def _optimizer_view(b: Bucket, index: int, buf: DataParallelBuffer) -> torch.Tensor:
        """What the optimizer sees of parameter ``index``: its local rows when the
        optimizer state is sharded, the whole parameter when it is replicated."""
        if b.sharding.main_weights:
            return buf.local_param_view(index)
        return buf.param_view(buf.data, index)

    def optimizer_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The sharded main weights as DTensor parameters, one per trainable original
        parameter, under its name; each ``.grad`` is a DTensor over its main-grad rows.
        Built once: in-place updates by an optimizer land in the main-weight buffers."""
        if self._optimizer_params is None:
            buckets = self._buffer.buckets
            params: list[tuple[str, nn.Parameter]] = []
            for name, gid, i, _p in self._buffer.named_params():
                b = buckets[gid]
                if not b.group.requires_grad:
                    continue
                slot = b.layout.slots[i]
                if slot.whole:
                    dparam = self._whole_param(b, i)
                    dparam._fsdp_group_index = (gid, i)  # type: ignore[attr-defined]
                    owner = dparam._fsdp_whole_owner  # type: ignore[attr-defined]
                    guard = WholeParameter(name, dparam, owner, b.main_weights.device)
                    guard._fsdp_group_index = (gid, i)  # type: ignore[attr-defined]
                    dparam._fsdp_guard = guard  # type: ignore[attr-defined]
                    params.append((name, dparam))
                    continue
                local = self._optimizer_view(b, i, b.main_weights)
                dparam = nn.Parameter(self._dtensor(b, i, local), requires_grad=True)
                dparam._fsdp_group_index = (gid, i)  # type: ignore[attr-defined]
                dparam._fsdp_row_partition = self._row_partition(b, i)  # type: ignore[attr-defined]
                dparam._fsdp_tp_partition = self._buffer.tp.partition(b.group.params[i])  # type: ignore[attr-defined]
                params.append((name, dparam))
            for _name, dparam in params:
                gid, i = dparam._fsdp_group_index  # type: ignore[attr-defined]
                self._params_of.setdefault(gid, []).append((i, dparam))
            self._optimizer_params = params
            self.attach_grads()
        return self._optimizer_params

    @staticmethod
    def _whole_param(b: Bucket, index: int) -> nn.Parameter:
        """The optimizer parameter of a whole-placed slot (module note): the whole main
        weight on its owner, a meta placeholder elsewhere."""
        slot = b.layout.slots[index]
        if slot.owner == b.shard.rank:
            dparam = nn.Parameter(b.main_weights.local_param_view(index), requires_grad=True)
        else:
            dparam = nn.Parameter(torch.empty(slot.shape, device="meta"), requires_grad=True)
        dparam._fsdp_whole_owner = slot.owner  # type: ignore[attr-defined]
        return dparam

    def attach_grads(self, only_with_grads: bool = False) -> None:
        """(Re)point every optimizer parameter's ``.grad`` (``grad_attr``) at its main-grad rows, e.g.
        after ``optimizer.zero_grad(set_to_none=True)`` dropped them. With
        ``only_with_grads``, only in buckets that a backward put gradients into since
        ``zero_grad_buffer``: others keep ``.grad`` as it is, so that a step without
        backward after ``zero_grad()`` skips their parameters (or applies zero
        gradients after ``zero_grad(set_to_none=False)``), as in plain PyTorch.

        Each gradient DTensor is made once and cached (``DTensor.from_local`` costs tens
        of microseconds a parameter); when its buffer's storage was replaced (released
        gradients come back in new storage) its local tensor is re-pointed there with
        ``Tensor.set_`` (about a microsecond), so the same objects follow."""
        buckets = self._buffer.buckets
        cache = self._grad_cache
        refreshed: dict[int, DataParallelBuffer] = {}  # once per bucket per call
        for _name, dparam in self._optimizer_params or ():
            gid, i = dparam._fsdp_group_index  # type: ignore[attr-defined]
            b = buckets[gid]
            if only_with_grads and not b.grads.has_grads:
                continue
            whole = b.layout.slots[i].whole
            if whole:  # the model's view has a gradient on every rank (whole_param)
                guard = dparam._fsdp_guard  # type: ignore[attr-defined]
                if guard.grad is not guard._fsdp_grad:
                    guard.grad = guard._fsdp_grad
                if b.layout.slots[i].owner != b.shard.rank:
                    continue  # a placeholder: no gradient here, the owner steps it
            gbuf = refreshed.get(gid)
            if gbuf is None:
                gbuf = refreshed[gid] = (
                    b.grads.grads_for_optimizer()
                    if self.grad_attr == "grad"
                    else b.grads.optimizer_grads
                )
                self._follow(gid, gbuf)
            cached = cache.get((gid, i))
            if cached is None or cached.buffer is not gbuf:
                data = gbuf.data
                view = self._optimizer_view(b, i, gbuf)
                local = _own(view)
                if whole:
                    grad = local
                else:  # over ``local`` itself (from_local would wrap a view of it)
                    spec = self._dtensor(b, i, local)._spec
                    grad = DTensor(local, spec, requires_grad=False)
                offset = view.storage_offset() - data.storage_offset()
                cached = cache[(gid, i)] = _GradView(grad, local, gbuf, data, offset)
            if getattr(dparam, self.grad_attr, None) is not cached.grad:
                setattr(dparam, self.grad_attr, cached.grad)

    def _follow(self, gid: int, gbuf: DataParallelBuffer) -> None:
        """Re-point bucket ``gid``'s cached gradient views made over ``gbuf`` at its
        storage now, where it was replaced (or they were parked) since."""
        cache = self._grad_cache
        data = storage = None
        for i, _dparam in self._params_of.get(gid, ()):
            cached = cache.get((gid, i))
            if cached is None or cached.buffer is not gbuf:
                continue
            if data is None:
                data = gbuf.data
            if cached.data is data:
                continue
            if storage is None:
                storage, base = data.untyped_storage(), data.storage_offset()
            cached.local.set_(storage, base + cached.offset, cached.size, cached.stride)
            cached.data = data

    def grads_in_use(self, gid: int) -> bool:
        """Whether an optimizer parameter of bucket ``gid`` holds its gradient view
        (``.grad``, or ``.decoupled_grad``): then its storage must stay, zeroed."""
        attr, cache = self.grad_attr, self._grad_cache
        for i, dparam in self._params_of.get(gid, ()):
            cached = cache.get((gid, i))
            if cached is not None and getattr(dparam, attr, None) is cached.grad:
                return True
        return False

    def park_grads(self, gid: int) -> None:
        """Bucket ``gid``'s gradient storage was released: point its cached gradient
        views at zeros (one shared element, expanded), so that they keep no storage
        alive; a stale reference someone kept reads zeros, and follows the next
        storage like the optimizer's ``.grad`` does."""
        cache, zeros = self._grad_cache, None
        for i, _dparam in self._params_of.get(gid, ()):
            cached = cache.get((gid, i))
            if cached is None or cached.data is None:
                continue
            local = cached.local
            if zeros is None or zeros.dtype != local.dtype or zeros.device != local.device:
                key = (local.dtype, local.device)
                zeros = self._zeros.get(key)
                if zeros is None:
                    zeros = self._zeros[key] = torch.zeros(1, dtype=key[0], device=key[1])
                storage = zeros.untyped_storage()
            local.set_(storage, 0, cached.size, cached.zero_stride)
            cached.data = None

    def forget_dropped_grads(self, unreached: Collection[nn.Parameter] = ()) -> None:
        """Before a backward, when the last one published its gradients: parameters
        whose gradient the user dropped since (``.grad`` set to None or replaced: an
        optimizer fsdp did not patch calling ``zero_grad()``, user code) get a fresh
        gradient from this backward, as FSDP2's do, instead of one added to the old:
        their rows of the main grads are zeroed, or the bucket's gradients released when
        every parameter of it was dropped (Note [released gradients]). ``unreached``:
        parameters whose ``.grad`` fsdp itself left None (no rank gave them one)."""
        attr, cache, buckets = self.grad_attr, self._grad_cache, self._buffer.buckets
        skip = {id(p) for p in unreached}
        for gid, members in self._params_of.items():
            b = buckets[gid]
            if not b.grads.has_grads:
                continue
            views = [(i, d, cache[(gid, i)]) for i, d in members if (gid, i) in cache]
            dropped = [
                (i, c)
                for i, d, c in views
                if getattr(d, attr, None) is not c.grad and id(d) not in skip
            ]
            if not dropped:
                continue
            with torch.no_grad():
                if len(dropped) == sum(id(d) not in skip for _i, d, _c in views):
                    if b.grads.zero_grads(release=True, keep_pending=True):
                        self.park_grads(gid)
                    continue
                if b.outer is not None:
                    names = [b.group.names[i] for i, _c in dropped]
                    raise NotImplementedError(
                        f"the gradients of {names[:3]} were dropped (.grad set to None) and "
                        f"those of other parameters of their bucket {gid} were kept; with "
                        "hybrid sharding fsdp drops gradients per bucket only: drop them all "
                        "(optimizer.zero_grad() over every parameter, model.zero_grad())"
                    )
                for i, _c in dropped:
                    self._optimizer_view(b, i, b.grads.main_grads).zero_()

    def drop_grads(self, params: list[nn.Parameter] | None = None) -> None:
        """``params`` (default: every optimizer parameter) hold no gradient: ``.grad``
        None, and ``.decoupled_grad`` None where gradients are decoupled."""
        if params is None:
            params = [p for _n, p in self._optimizer_params or ()]
        for dparam in params:
            dparam.grad = None
            if self.grad_attr != "grad":
                setattr(dparam, self.grad_attr, None)

    def distributed_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """A DTensor parameter for every original parameter, under its name: the
        optimizer's main-weight parameters for trainable ones, and views of the
        model-weight shards (``requires_grad=False``) for frozen or integer ones."""
        if self._distributed_params is None:
            trainable = dict(self.optimizer_named_parameters())
            frozen = self.local_shard_dtensors()
            out: list[tuple[str, nn.Parameter]] = []
            for name, _gid, _i, _p in self._buffer.named_params():
                if name in trainable:
                    dparam = trainable[name]
                    # A whole-placed one: its WholeParameter (see whole_param).
                    out.append((name, getattr(dparam, "_fsdp_guard", dparam)))
                else:
                    dparam = nn.Parameter(frozen[name], requires_grad=False)
                    dparam._fsdp_row_partition = frozen[name]._fsdp_row_partition  # type: ignore[attr-defined]
                    dparam._fsdp_tp_partition = frozen[name]._fsdp_tp_partition  # type: ignore[attr-defined]
                    out.append((name, dparam))
            self._distributed_params = out
        return self._distributed_params

    def _weights_of(self, b: Bucket) -> tuple[DataParallelBuffer, bool]:
        """The buffer holding a bucket's weights for state (main weights where they
        exist, model weights otherwise) and whether this rank holds only its part."""
        group = b.group
        buf = b.main_weights if group.requires_grad else b.model
        sharded = buf.is_data_distributed or (group.requires_grad and b.sharding.main_weights)
        return buf, sharded

    def local_shard_dtensors(self) -> dict[str, DTensor]:
        """Every parameter's local shard as a DTensor under its name, without
        communication: main weights where they exist, model weights otherwise.
        Whole-placed parameters have none (module note) and are left out."""
        out: dict[str, DTensor] = {}
        tp = self._buffer.tp
        for name, gid, i, p in self._buffer.named_params():
            b = self._buffer.buckets[gid]
            if b.layout.slots[i].whole:
                continue
            buf, sharded = self._weights_of(b)
            split = self._is_sharded_slot(b, i, sharded)
            placement = Shard(0) if split else Replicate()
            local = buf.local_param_view(i) if sharded else buf.param_view(buf.data, i)
            mesh = b.optimizer_mesh if b.group.requires_grad else b.shard_mesh
            out[name] = self._view(b, i, local, placement, mesh)
            out[name]._fsdp_row_partition = self._row_partition(b, i) if split else None  # type: ignore[attr-defined]
            out[name]._fsdp_tp_partition = tp.partition(p)  # type: ignore[attr-defined]
        return out

    def _row_partition(self, b: Bucket, index: int) -> tuple[tuple[int, int], ...] | None:
        """Rows [start, end) of the parameter on each coordinate of its DTensors' mesh
        (``torch.chunk``'s pieces), or None when it is replicated."""
        sharding = b.sharding
        if not self._is_sharded_slot(b, index, sharding.main_weights or sharding.model_weights):
            return None
        return b.layout.row_partition(index)

    # ---- whole-placed parameters in the row placement (state dicts) --------------------
    def whole_names(self) -> list[str]:
        """The names of the whole-placed trainable parameters, in a rank-independent order."""
        return [
            name for name, p in self.optimizer_named_parameters() if hasattr(p, "_fsdp_whole_owner")
        ]

    def whole_full(
        self,
        name: str,
        value: torch.Tensor | None,
        like: tuple[torch.Size, torch.dtype] | None = None,
    ) -> torch.Tensor:
        """``value`` (held by parameter ``name``'s owner; ignored elsewhere; None: the
        main weight) whole on every rank of the shard group: a broadcast from the owner,
        on the buffer's device. ``like``: its (shape, dtype), which the other ranks must
        know (default: the parameter's shape and the main weights' dtype)."""
        gid, i = self.index_of(name)
        b = self._buffer.buckets[gid]
        slot = b.layout.slots[i]
        if not slot.whole:
            raise ValueError(
                f"whole_full: parameter {name!r} is not whole-placed (no rank owns it "
                "whole); use full_parameter for a row-placed or replicated one"
            )
        shape, dtype = like if like is not None else (slot.shape, b.main_weights.dtype)
        device = b.main_weights.device
        if slot.owner == b.shard.rank:
            source = b.main_weights.local_param_view(i) if value is None else value
            full = source.detach().to(device=device, dtype=dtype, copy=True)
        else:
            full = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(full, src=_global_rank(b, slot.owner), group=b.shard.group)
        return full

    def whole_owner_object(self, name: str, obj: object) -> object:
        """``obj`` (on parameter ``name``'s owner) on every rank of its shard group."""
        gid, i = self.index_of(name)
        b = self._buffer.buckets[gid]
        owner = b.layout.slots[i].owner
        box = [obj if owner == b.shard.rank else None]
        dist.broadcast_object_list(box, src=_global_rank(b, owner), group=b.shard.group)
        return box[0]

    def whole_is_mine(self, name: str) -> bool:
        """Whether this rank owns whole-placed parameter ``name``."""
        gid, i = self.index_of(name)
        b = self._buffer.buckets[gid]
        return b.layout.slots[i].owner == b.shard.rank

    def whole_replicated(self, name: str, full: torch.Tensor) -> DTensor:
        """``full`` (alike on every rank) as a ``Replicate`` DTensor on parameter
        ``name``'s optimizer mesh."""
        gid, _i = self.index_of(name)
        mesh = self._buffer.buckets[gid].optimizer_mesh
        return DTensor.from_local(full, mesh, [Replicate()], run_check=False)

    def whole_row_dtensor(self, name: str, full: torch.Tensor) -> DTensor:
        """The DTensor a row-placed model gives for ``full`` (parameter ``name``'s value,
        whole on every rank): ``Shard(0)`` ``torch.chunk`` pieces on the optimizer mesh,
        as a copy (``full`` may be freed). No communication."""
        gid, _i = self.index_of(name)
        b = self._buffer.buckets[gid]
        pieces = torch.chunk(full, b.shard.size, dim=0)
        rank = b.shard.rank
        local = pieces[rank].clone() if rank < len(pieces) else full[:0].clone()
        return DTensor.from_local(
            local,
            b.optimizer_mesh,
            [Shard(0)],
            run_check=False,
            shape=full.shape,
            stride=full.stride(),
        )

    def whole_set(self, name: str, full: torch.Tensor) -> None:
        """Write ``full`` (parameter ``name``'s value, whole on every rank) into its
        owner's main weights (the others hold nothing of it)."""
        gid, i = self.index_of(name)
        b = self._buffer.buckets[gid]
        if b.layout.slots[i].owner == b.shard.rank:
            with torch.no_grad():
                b.main_weights.local_param_view(i).copy_(full)

    def index_of(self, name: str) -> tuple[int, int]:
        """(bucket, position) of the parameter named ``name``."""
        if self._name_index is None:
            self._name_index = {n: (gid, i) for n, gid, i, _p in self._buffer.named_params()}
        try:
            return self._name_index[name]
        except KeyError:
            raise KeyError(f"no parameter named {name!r} in this buffer") from None

    def local_rows(self, name: str) -> tuple[int, int]:
        """The global rows [start, end) of parameter ``name`` this rank holds."""
        gid, i = self.index_of(name)
        b = self._buffer.buckets[gid]
        if b.outer_sharded:
            buf = b.main_weights
            return buf.layout.local_rows(i, buf.shard_rank)
        return b.layout.local_rows(i, b.shard.rank)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, under its name (``full_parameter`` of each)."""
        return {name: self.full_parameter(name) for name, *_ in self._buffer.named_params()}

    def full_parameter(self, name: str) -> torch.Tensor:
        """The whole parameter ``name`` (main weights where they exist), gathered from
        its row shards (and, when it is tensor-parallel, from its tp pieces). A
        collective: every rank of the shard group (and the tp group) must call it; the
        same as ``full_tensor()`` of its DTensor."""
        gid, i = self.index_of(name)
        b = self._buffer.buckets[gid]
        p = b.group.params[i]
        tp = self._buffer.tp
        buf, sharded = self._weights_of(b)
        slot = buf.layout.slots[i]
        if not sharded:
            return tp.full(p, buf.param_view(buf.data, i).clone())
        if slot.whole:  # the owner holds it all (in the main weights): a broadcast from it
            return self.whole_full(name, None)
        if slot.replicated:
            return tp.full(p, buf.local_param_view(i).clone())
        partition = buf.layout.row_partition(i)
        pg = b.shard.group
        if b.outer_sharded and b.group.requires_grad:
            partition = self._row_partition(b, i)
            pg = self._buffer.dist_index.get_dp_group(is_expert_parallel=b.group.is_expert_param)
        # Rows (a 0-d parameter is one row of one element), placed in row order: the
        # coordinates of a fully-sharded hybrid mesh do not hold increasing rows.
        local = buf.local_param_view(i).reshape(-1, *slot.shape[1:])
        full = collectives.all_gather_uneven(local, 0, partition, pg)
        return tp.full(p, full.view(slot.shape))


class _GradView:
    """A cached optimizer gradient (a DTensor, or the plain tensor of a whole-placed
    slot), its local tensor (not a view of anything: ``set_`` re-points it and it keeps
    no other tensor alive), the buffer it belongs to, the storage tensor it points into
    now (None while parked on zeros) and its offset in elements from that tensor's
    start."""

    __slots__ = ("buffer", "data", "grad", "local", "offset", "size", "stride", "zero_stride")

    def __init__(
        self,
        grad: torch.Tensor,
        local: torch.Tensor,
        buffer: DataParallelBuffer,
        data: torch.Tensor,
        offset: int,
    ) -> None:
        self.grad, self.local, self.buffer, self.data = grad, local, buffer, data
        self.offset, self.size, self.stride = offset, local.size(), local.stride()
        self.zero_stride = (0,) * local.dim()  # parked: every element the one zero


# Note [picklable views]
# A DTensor's wrapper carries its local tensor's storage offset (torch >= 2.10), and
# torch's pickler (``Tensor._reduce_ex_internal``, also ``__deepcopy__``) tells a wrapper
# subclass from a tensor with data by ``data_ptr() == 0``: a wrapper at a nonzero offset
# has a nonzero data pointer over no storage, so ``torch.save`` raises "invalid python
# storage". FSDP2's DTensors pickle because each parameter owns its storage (offset 0);
# ours are views into a bucket's flat buffer. So the local tensor of every DTensor view
# of a buffer is the same memory under a storage of its own that begins at its first
# element (a DLPack alias: it keeps the buffer's storage alive, and writes through it
# reach the buffer). Every DTensor derived from it (``detach()`` in ``state_dict``,
# ``.data``, optimizer state made ``*_like`` it) then has offset 0, and ``torch.save``
# writes only the parameter's bytes. The buffers these views are made over are never
# resized in place (only the gather buffers of ``TemporaryBucketAllocator`` are, and no
# DTensor is made over those), so the alias never outlives its memory.
def storage_from_start(view: torch.Tensor) -> torch.Tensor:
    """``view``'s memory (detached) under a storage that begins at its first element
    (Note [picklable views]); meta tensors, which have no memory, are returned as they are."""
    if view.is_meta:
        return view.detach()
    return torch.from_dlpack(view.detach())


def _own(view: torch.Tensor) -> torch.Tensor:
    """A tensor over ``view``'s memory that is not a view (no ``_base`` to keep alive)."""
    out = torch.empty(0, dtype=view.dtype, device=view.device)
    return out.set_(view.untyped_storage(), view.storage_offset(), view.size(), view.stride())


def _global_rank(b: Bucket, shard_rank: int) -> int:
    """The global rank of ``b``'s shard-group rank ``shard_rank`` (a broadcast's ``src``)."""
    group = b.shard.group
    return shard_rank if group is None else dist.get_global_rank(group, shard_rank)
