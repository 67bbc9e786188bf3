"""Meta-device initialization: materialize a model built on the meta device shard by shard.

Note on meta initialization. A model built under ``with torch.device("meta")`` has
shapes and no data. ``MegatronFSDP(..., init_model_with_meta_device=True)`` turns it
into a trained-ready sharded model without any rank ever holding the whole of it:

1. ``prepare_meta_init`` (before the ``ParamAndGradBuffer`` is built) gives every meta
   parameter a storage-less placeholder on the target device, *in place*
   (``torch.utils.swap_tensors``: same object, so ties, attributes and user references
   survive), and marks it pending. A parameter that is already real keeps a reference
   to its value, which is copied into the buffers (only meta tensors are initialized).
2. The buffers are allocated zeroed and the compute parameters become views into them,
   as for any model.
3. ``initialize_from_meta`` walks the modules in post-order (children before their
   parent: the order in which ``__init__`` methods *finish*, hence the order in which an
   eager construction calls ``reset_parameters()``) and calls ``reset_parameters()`` on
   every module whose subtree held something on the meta device, the convention of
   PyTorch FSDP's meta-device initialization (``_reset_parameters()`` where a torch
   module spells it so). A module under a model with ``_init_weights(module)`` (a
   Hugging Face ``PreTrainedModel``: the nearest one above it) then gets
   ``model._init_weights(module)``, which overrides the reset's values as its
   ``post_init`` does in an eager construction; rotary ``inv_freq``, norms, routers and
   fused experts are initialized so. The values follow the model's own initializer;
   the random stream is not the eager construction's for such models (eager draws all
   resets first, then all ``_init_weights``; this draws both per module, to hold one
   unit at a time). Every rank runs every reset on full
   tensors, so the random stream is consumed exactly as by the eager construction
   ``torch.manual_seed(s); Model()``, and each rank then keeps its own rows. A
   parameter group is materialized from the first reset that can touch it to the last
   one: a sharded group in a temporary flat tensor of the group's layout (the
   parameters' ``.data`` point into it meanwhile), a replicated group directly in its
   buffer. When a group's last reset has run, this rank's shard of the temporary tensor
   is copied into the persistent model-weight shard and the main-weight buffer, the
   parameters point back into their (freed) bucket, and the temporary tensor is
   dropped. So a rank holds its shards plus about one FSDP unit: the groups open at
   once are the current unit's and the root groups still to be used later (embedding
   and final norm, say, which the forward also keeps gathered).

A parameter reachable from several modules (tied weights) belongs to the first of them
in that order and keeps its values. ``head.weight = tok.weight`` in an eager
``__init__`` discards the head's own initialization after it consumed random numbers,
so a later module whose parameter belongs to an earlier one runs its reset against a
scratch tensor of the same shape, and the stream advances identically. (A tie made the
other way round, ``tok.weight = head.weight``, keeps the *later* module's values in an
eager construction: not reproduced, the first module's initialization is kept.) Real
parameters are swapped for scratch tensors too during the reset of their module.

Tensor parallelism: a DTensor parameter (a model parallelized on the meta device with
``parallelize_module``) is swapped, during its module's reset, for a plain tensor of its
global shape, as the eager model had it before it was parallelized (same random draws,
same fan-in); this rank keeps its tp piece (``torch.chunk``'s, as DTensor makes them).
Every tp rank must then draw the same numbers too (checked with the data-parallel
ranks). A Megatron-Core style plain tp-local parameter is reset as it is, on its local
piece (as Megatron-FSDP does): its module's reset decides which piece it draws.

Resets are assumed to touch only their module's subtree. A reset that spans several
FSDP units (a root ``reset_parameters`` that re-initializes every layer) is run
correctly, with all those units materialized at once, and warned about.

What cannot be reproduced is refused, never left as zeros: a meta parameter or buffer
that no ``reset_parameters()`` of its module or of a module above it can initialize
(values set in ``__init__`` are not recorded on the meta device) raises ``ValueError``
before any work, naming them (but meta buffers under a root module with
``init_weights()`` are left to it: Note [the model's init_weights]); a parameter or
floating buffer that the resets left untouched (they are filled with NaN beforehand, a
value no initializer writes) raises after the reset. Every rank runs the same checks on
the same model, so every rank raises. The random generators of the data-parallel
ranks must be in the same state (``torch.manual_seed(s)`` on every rank before
wrapping): this is checked with one small collective.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_buffers import ParamAndGradBuffer, annotate
from fsdp_buffers.no_shard import copy_param_attributes
from fsdp_hooks.setup.meta_plan import Plan, Reset, make_plan
from fsdp_hooks.setup.validation import digest, gather_ints
from fsdp_mesh import FSDPDistributedIndex
from fsdp_mesh.device import warn_once


class _Wrapper(Protocol):
    """What meta initialization reads of a ``MegatronFSDP`` (which calls it after its
    buffers exist)."""

    module: nn.Module
    buffer: ParamAndGradBuffer
    dist_index: FSDPDistributedIndex


__all__ = [
    "META_INIT_PENDING_ATTR",
    "defer_meta_init",
    "initialize_from_meta",
    "local_of",
    "prepare_meta_init",
    "run_model_init_weights",
    "set_local",
]

logger = logging.getLogger("fsdp_hooks")

META_INIT_PENDING_ATTR = "_fsdp_meta_init_pending"
"""Set on a parameter that was on the meta device and still needs initialization."""

_VALUE_ATTR = "_fsdp_meta_init_value"  # a real parameter's value, kept across the rebuild
_NAN_CHECK_CHUNK = 1 << 22  # elements per isnan() pass: bounds its temporary to 4 MiB


# ---- before the buffers are built -------------------------------------------------------
def prepare_meta_init(module: nn.Module, device: torch.device) -> None:
    """Give every meta parameter of ``module`` a storage-less placeholder on ``device``
    in place (object identity, class, attributes and ties are kept) and mark it pending;
    remember the value of every parameter that is already real."""
    seen: set[int] = set()
    for mod_name, mod in module.named_modules():
        for name, p in mod._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            if not p.is_meta:
                setattr(p, _VALUE_ATTR, local_of(p).detach())
                continue
            # One element, expanded: the buffers replace .data with a view right away.
            placeholder = _placeholder(p, device)
            new = nn.Parameter(placeholder, requires_grad=p.requires_grad)
            if type(p) is not nn.Parameter:
                new.__class__ = type(p)
            new.__dict__.update(p.__dict__)
            try:
                torch.utils.swap_tensors(p, new)
            except RuntimeError as e:
                full = f"{mod_name}.{name}" if mod_name else name
                raise RuntimeError(
                    f"cannot materialize meta parameter {full!r} in place for meta-device "
                    f"initialization: {e}. Do not hold other references (weak references, "
                    f"autograd graphs) to the model's parameters while wrapping it."
                ) from e
            setattr(p, META_INIT_PENDING_ATTR, True)


def local_of(p: torch.Tensor) -> torch.Tensor:
    """What fsdp stores of ``p``: its local tensor (this rank's tp piece) for a DTensor."""
    return p._local_tensor if isinstance(p, DTensor) else p.data


def set_local(p: nn.Parameter, t: torch.Tensor) -> None:
    """Point ``p`` at ``t`` (a DTensor's local tensor: the object, its mesh and
    placements stay, as the buffers do it)."""
    if isinstance(p, DTensor):
        p._local_tensor = t
    else:
        p.data = t


def _placeholder(p: nn.Parameter, device: torch.device) -> torch.Tensor:
    """A storage-less stand-in for meta ``p`` on ``device``; a DTensor (tensor
    parallelism) keeps its mesh, placements and global shape over a local stand-in."""
    if not isinstance(p, DTensor):
        return torch.empty((), dtype=p.dtype, device=device).expand(p.shape)
    local = torch.empty((), dtype=p.dtype, device=device).expand(p.to_local().shape)
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


# ---- materializing groups -------------------------------------------------------------------
@dataclass(eq=False)
class _OpenGroup:
    """A group being initialized: ``flat`` holds all of it, and ``views`` are where its
    parameters' ``.data`` point meanwhile."""

    gid: int
    flat: torch.Tensor
    views: dict[nn.Parameter, torch.Tensor]
    bucket_views: dict[nn.Parameter, torch.Tensor]  # to restore (sharded groups only)


class _Materializer:
    def __init__(self, buffer: ParamAndGradBuffer, plan: Plan) -> None:
        self.buffer = buffer
        self.plan = plan
        self.open: dict[int, _OpenGroup] = {}
        self.live_bytes = 0
        self.peak_bytes = 0  # temporary bytes this code holds (logged; tests measure)

    def _track(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def open_group(self, gid: int) -> None:
        group = self.buffer.groups[gid]
        buf = group.model_weight_buffer
        assert buf is not None
        views: dict[nn.Parameter, torch.Tensor] = {}
        bucket_views: dict[nn.Parameter, torch.Tensor] = {}
        # A compute copy in another dtype (param_dtype): initialize in the parameters'
        # own dtype, so the main weights get the full-precision values.
        if buf.is_data_distributed or buf.dtype != group.dtype:
            flat = torch.zeros(buf.layout.total_numel, dtype=group.dtype, device=buf.device)
            self._track(flat.numel() * flat.element_size())
            for i, p in enumerate(group.params):
                bucket_views[p] = local_of(p)
                views[p] = buf.param_view(flat, i)
                set_local(p, views[p])
        else:
            flat = buf.data
            for i, p in enumerate(group.params):
                views[p] = buf.param_view(flat, i)
        if flat.dtype.is_floating_point or flat.dtype.is_complex:
            for p in group.params:
                if getattr(p, META_INIT_PENDING_ATTR, False):
                    views[p].fill_(float("nan"))  # "not initialized", checked on close
        self.open[gid] = _OpenGroup(gid, flat, views, bucket_views)

    def close_group(self, gid: int, check: bool = True) -> None:
        """Copy open group ``gid`` into its buffers; with ``check``, first refuse a pending
        parameter its resets left NaN (without: the model's own init fills it later)."""
        og = self.open.pop(gid)
        group = self.buffer.groups[gid]
        buf = group.model_weight_buffer
        assert buf is not None
        with torch.no_grad():
            for p in group.params:
                value = getattr(p, _VALUE_ATTR, None)
                if value is not None:
                    og.views[p].copy_(value)
            if check and (og.flat.dtype.is_floating_point or og.flat.dtype.is_complex):
                bad = [
                    self.plan.param_names.get(p, "?")
                    for p in group.params
                    if getattr(p, META_INIT_PENDING_ATTR, False) and _any_nan(og.views[p])
                ]
                if bad:
                    raise ValueError(
                        f"meta-device initialization: reset_parameters() ran but left "
                        f"parameter(s) {bad} uninitialized (they would silently stay "
                        f"zero). Make the reset_parameters() of the module that owns "
                        f"them initialize every parameter it owns, or build that module "
                        f"on a real device before wrapping."
                    )
            if og.flat is not buf.data:
                buf.load_from_unsharded(og.flat)
            main = group.main_weight_buffer
            if main is not None:
                main.load_from_unsharded(og.flat)
            # Fully-sharded HSDP: the fine main weights hold this rank's piece of the
            # shard x outer layout (a view of the compute shard when the dtypes agree).
            outer = self.buffer.buckets[gid].outer
            fine = outer.fine_main if outer is not None else None
            if fine is not None and fine.data.data_ptr() != outer.fine_slice(buf.data).data_ptr():
                fine.load_from_unsharded(og.flat)
        for p, bucket_view in og.bucket_views.items():
            set_local(p, bucket_view)
        if og.flat is not buf.data:
            self._track(-og.flat.numel() * og.flat.element_size())

    def run_reset(self, reset: Reset) -> None:
        mod = reset.module
        originals = {attr: mod._parameters[attr] for attr in mod._parameters}
        expected = {
            attr: self._view_of(p)
            for attr, p in originals.items()
            if p is not None and attr not in reset.scratch
        }
        # A DTensor (tensor-parallel) parameter is reset as the whole plain tensor the
        # eager model had before it was parallelized (the same random draws, fan-in and
        # so on); this rank then keeps its tp piece.
        whole = [attr for attr in expected if isinstance(originals[attr], DTensor)]
        scratch_bytes = 0
        try:
            for attr in [*reset.scratch, *whole]:
                p = originals[attr]
                assert p is not None
                tensor = torch.empty(p.shape, dtype=p.dtype, device=self.buffer.device)
                scratch_bytes += tensor.numel() * tensor.element_size()
                mod._parameters[attr] = copy_param_attributes(
                    p, nn.Parameter(tensor, requires_grad=p.requires_grad)
                )
            self._track(scratch_bytes)
            try:
                with torch.no_grad(), torch.device(self.buffer.device):
                    reset.run()
            except Exception as e:
                raise RuntimeError(
                    f"initialization (reset_parameters() / the model's _init_weights) of module {reset.name or '<root>'!r} "
                    f"({type(mod).__name__}) failed during meta-device initialization: {e}"
                ) from e
            # A reset may assign new Parameter objects or new .data: keep the buffers'.
            for attr, view in expected.items():
                p = originals[attr]
                assert p is not None
                now = mod._parameters.get(attr)
                if attr in whole:
                    assert now is not None
                    with torch.no_grad():
                        view.copy_(self._tp_piece(p, now.detach()))
                elif now is not p and now is not None:
                    with torch.no_grad():
                        view.copy_(now.detach())
                elif p.data.data_ptr() != view.data_ptr() or p.shape != view.shape:
                    with torch.no_grad():
                        view.copy_(p.detach())
                    p.data = view
        finally:
            for attr, p in originals.items():
                mod._parameters[attr] = p
            self._track(-scratch_bytes)

    def _tp_piece(self, p: nn.Parameter, whole: torch.Tensor) -> torch.Tensor:
        """This rank's tensor-parallel piece of DTensor ``p``'s whole value."""
        spec = self.buffer.tp.spec(p)
        assert spec is not None and isinstance(p, DTensor)
        if spec.ranges is None:
            return whole
        assert spec.tensor_dim is not None
        start, end = spec.ranges[p.device_mesh.get_local_rank()]
        return whole.narrow(spec.tensor_dim, start, end - start)

    def _view_of(self, p: nn.Parameter) -> torch.Tensor:
        for og in self.open.values():
            view = og.views.get(p)
            if view is not None:
                return view
        return p.data


def _any_nan(t: torch.Tensor) -> bool:
    flat = t.reshape(-1)
    return any(
        bool(torch.isnan(flat[i : i + _NAN_CHECK_CHUNK]).any())
        for i in range(0, flat.numel(), _NAN_CHECK_CHUNK)
    )


# ---- the entry point ----------------------------------------------------------------------
def initialize_from_meta(wrapper: _Wrapper) -> list[tuple[nn.Module, str, str]]:
    """Initialize ``wrapper.module``'s meta parameters and buffers by running
    ``reset_parameters()``, one FSDP unit at a time, into this rank's shards (see the
    module note). Called by ``MegatronFSDP`` after its buffers exist, when
    ``init_model_with_meta_device=True``; ``prepare_meta_init`` must have run first.
    Returns the meta buffers left to the model's ``init_weights()`` (Note [the model's
    init_weights]), which ``run_model_init_weights`` fills once the model is wrapped."""
    buffer: ParamAndGradBuffer = wrapper.buffer
    module = wrapper.module
    params = list(buffer.param_index)
    pending = {p for p in params if getattr(p, META_INIT_PENDING_ATTR, False)}
    try:
        with annotate("fsdp.meta_init"):
            plan = make_plan(module, pending)
            if plan.resets:
                _check_same_rng_state(wrapper)
            _materialize_buffers(module, buffer.device, meta=True)
            _run(buffer, plan)
            _check_buffers(plan.meta_buffers, plan.left_to_init_weights)
    finally:
        _clear_marks(params)
    return plan.left_to_init_weights


# Note [the model's init_weights]
# torchtitan's models (and FSDP2's meta-device recipe) initialize through the root
# module's ``init_weights()``: build on the meta device, ``fully_shard``, then
# ``model.to_empty(device=...)`` and ``model.init_weights()``, which writes the sharded
# DTensor parameters in place and recomputes buffers such as the RoPE cache
# (``freqs_cis``), on modules with no ``reset_parameters()``. Both routes work here:
# - without ``init_model_with_meta_device`` (FSDP2's way, ``defer_meta_init``): the meta
#   parameters' shards are allocated filled with NaN (an init the user forgets shows
#   as NaN at once, never as plausible zeros), the meta buffers stay on the meta device
#   until ``to_empty`` (``MegatronFSDP._apply``), and the user's ``init_weights()``
#   writes through the DTensors (the runtime carries the writes to the compute weights
#   at the next forward, as for any write between steps);
# - with it, per-module ``reset_parameters()`` initialize what they reach, one unit at a
#   time, and meta buffers that none reaches are left, when the root module defines
#   ``init_weights()``, to one call of it once the model is wrapped (as the user would
#   call it on FSDP2's model): the recipe torchtitan users already have, instead of a
#   new option to pass an init function. Those buffers must be initialized then (checked:
#   not NaN, not meta), or the wrap raises naming them. ``init_weights()`` re-initializes
#   the parameters it writes too, as it does on FSDP2's model.
# On CPU a random init of a sharded DTensor draws each rank's shard from its own
# generator (as on FSDP2's model), so it equals one process's only where the init is
# deterministic per parameter; on CUDA DTensor's offset-based generator makes it equal.
def defer_meta_init(wrapper: _Wrapper) -> None:
    """FSDP2's meta route (Note [the model's init_weights]): the meta parameters' shards,
    allocated by the buffers, are filled with NaN for the model's own init after
    wrapping; real parameters keep their values; meta buffers stay on the meta device
    for ``to_empty``, real ones move to the device. ``prepare_meta_init`` ran first."""
    buffer: ParamAndGradBuffer = wrapper.buffer
    params = list(buffer.param_index)
    try:
        with annotate("fsdp.meta_init"):
            _materialize_buffers(wrapper.module, buffer.device, meta=False)
            mat = _Materializer(buffer, Plan())
            for gid in range(len(buffer.groups)):
                mat.open_group(gid)
                mat.close_group(gid, check=False)
    finally:
        _clear_marks(params)


def run_model_init_weights(
    module: nn.Module, device: torch.device, buffers: list[tuple[nn.Module, str, str]]
) -> None:
    """Call the wrapped ``module``'s own ``init_weights()`` for the meta ``buffers`` no
    ``reset_parameters()`` reaches (Note [the model's init_weights]), then refuse any of
    them it left uninitialized."""
    if not buffers:
        return
    try:
        with torch.no_grad(), torch.device(device):
            module.init_weights()  # type: ignore[operator]
    except Exception as e:
        raise RuntimeError(
            f"meta-device initialization: {type(module).__name__}.init_weights(), called to "
            f"initialize the buffers {[full for _m, _a, full in buffers][:5]} that no "
            f"reset_parameters() reaches, failed: {e}"
        ) from e
    _check_buffers(buffers, [])


def _clear_marks(params: list[nn.Parameter]) -> None:
    for p in params:
        for attr in (META_INIT_PENDING_ATTR, _VALUE_ATTR):
            if hasattr(p, attr):
                delattr(p, attr)


def _run(buffer: ParamAndGradBuffer, plan: Plan) -> None:
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for reset in plan.resets:
        for p in reset.touches:
            gid = buffer.group_of(p)[0]
            first.setdefault(gid, reset.index)
            last[gid] = reset.index
    opens: dict[int, list[int]] = {}
    closes: dict[int, list[int]] = {}
    for gid in sorted(first):
        opens.setdefault(first[gid], []).append(gid)
        closes.setdefault(last[gid], []).append(gid)
    mat = _Materializer(buffer, plan)
    for reset in plan.resets:
        units = {buffer.groups[buffer.group_of(p)[0]].fsdp_unit_id for p in reset.touches}
        units.discard(None)
        if len(units) > 1:
            warn_once(
                f"fsdp.meta_init.wide_reset.{type(reset.module).__qualname__}",
                f"meta-device initialization: reset_parameters() of "
                f"{reset.name or '<root>'!r} ({type(reset.module).__name__}) reaches "
                f"{len(units)} FSDP units, which are all materialized at once for it; "
                f"keep each reset_parameters() to its own module's parameters to hold "
                f"one unit at a time",
            )
        with annotate("fsdp.meta_init.reset"):
            for gid in opens.get(reset.index, ()):
                mat.open_group(gid)
            mat.run_reset(reset)
            for gid in closes.get(reset.index, ()):
                mat.close_group(gid)
    # Groups no reset touches hold only real parameters: copy their values in.
    for gid in range(len(buffer.groups)):
        if gid not in first:
            mat.open_group(gid)
            mat.close_group(gid)
    logger.debug(
        "meta init: %d resets, %d groups, peak temporary %.1f MiB",
        len(plan.resets),
        len(buffer.groups),
        mat.peak_bytes / 2**20,
    )


def _materialize_buffers(module: nn.Module, device: torch.device, meta: bool) -> None:
    """With ``meta``, meta buffers get (NaN-filled) storage on ``device``, shared ones
    once (without, they stay for ``to_empty``); real buffers move to ``device`` like
    ``module.to(device)`` would move them."""
    made: dict[int, torch.Tensor] = {}
    for mod in module.modules():
        for attr, b in mod._buffers.items():
            if b is None:
                continue
            if b.is_meta:
                if not meta:
                    continue
                new = made.get(id(b))
                if new is None:
                    new = torch.empty(b.shape, dtype=b.dtype, device=device)
                    if new.is_floating_point() or new.is_complex():
                        new.fill_(float("nan"))
                    else:
                        new.zero_()
                    made[id(b)] = new
                mod._buffers[attr] = new
            elif b.device != device:
                mod._buffers[attr] = made.setdefault(id(b), b.to(device))


def _check_buffers(
    buffers: list[tuple[nn.Module, str, str]], skip: list[tuple[nn.Module, str, str]]
) -> None:
    """Refuse a buffer of ``buffers`` (not in ``skip``) left on the meta device or NaN."""
    skipped = {(id(mod), attr) for mod, attr, _full in skip}
    bad = [
        full
        for mod, attr, full in buffers
        if (id(mod), attr) not in skipped
        and (b := mod._buffers.get(attr)) is not None
        and (b.is_meta or ((b.is_floating_point() or b.is_complex()) and _any_nan(b)))
    ]
    if bad:
        raise ValueError(
            f"meta-device initialization: reset_parameters() (or the model's "
            f"init_weights()) ran but left buffer(s) {bad} uninitialized (values computed "
            f"in __init__ are not recorded on the meta device). Compute them in "
            f"reset_parameters() or the root module's init_weights(), or create those "
            f"buffers on a real device before wrapping."
        )


def _rng_state(device: torch.device) -> torch.Tensor | None:
    if device.type == "cpu":
        return torch.get_rng_state()
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return None


def _check_same_rng_state(wrapper: _Wrapper) -> None:
    """Every data-parallel rank must draw the same random numbers, or their shards would
    come from different models."""
    if not dist.is_initialized():
        return
    state = _rng_state(wrapper.buffer.device)
    if state is None:
        return
    # Under tensor parallelism the tp ranks too: each keeps its piece of one draw.
    idx = wrapper.dist_index
    for group, which in ((idx.get_dp_group(), "data-parallel"), (idx.tp_group, "tensor-parallel")):
        if group is not None and dist.get_world_size(group) > 1:
            _check_same_rng_in(wrapper, state, group, which)


def _check_same_rng_in(wrapper: _Wrapper, state: torch.Tensor, group, which: str) -> None:
    mine = digest(bytes(state.cpu().tolist()))
    values = [row[0] for row in gather_ints([mine], group, wrapper.dist_index.device_type)]
    if len(set(values)) > 1:
        differ = [r for r, v in enumerate(values) if v != values[0]]
        raise ValueError(
            f"meta-device initialization: the {wrapper.buffer.device.type} random generator "
            f"differs across {which} ranks (group ranks {differ} differ from group "
            f"rank 0), so their shards would come from different models. Seed every rank "
            f"the same (torch.manual_seed(seed)) before wrapping; seed per rank afterwards "
            f"if you want different dropout streams."
        )
