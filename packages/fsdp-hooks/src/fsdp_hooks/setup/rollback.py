"""Undo a wrap that raised, on every rank: the module gets back its parameters, hooks and
attributes.

Wrapping moves each parameter's storage into fsdp's buffers group by group (its
``.data`` becomes a view into a bucket), registers hooks and tags parameters. An
exception after that (an allocation failing for a later group, a bad option found late)
used to leave parameters viewing buckets that were freed with the half-built wrapper:
printing one then read freed memory. ``rollback_on_failure`` puts back every parameter
object in its module slot, removes the hooks and attributes the wrap added, and gives
each parameter its values back.

Failure-atomic across ranks: a failure may happen on one rank only, after other ranks'
groups were split (under ZeRO-3 a moved group's values then exist only as shards spread
over the ranks). So the wrap ends with an agreement (one ``all_gather_object`` over the
data-parallel group, on success too): every rank learns which ranks failed and why; if
any did, every rank restores its module and raises, naming them. Values: ZeRO-0/1/2
buckets hold the whole compute weights, read back from them; under ZeRO-3
(``keep_values``) the original tensors are kept alive until the agreement instead of
being freed group by group. That costs the sharded buffers on top of the model while
wrapping (the model was resident before the wrap anyway: peak ``model + model/N`` of
each buffer kind, instead of ``model + one group``), and nothing after it; gathering
the shards back instead would need every rank to rebuild the same buckets, which a rank
that failed half-way through building them cannot. Parameters on the meta device before
the wrap (``init_model_with_meta_device``) are put back there. A parameter whose values
cannot be restored (not kept and its bucket freed; not reached by the cases above)
becomes a meta-device parameter of its shape and dtype (any use raises; the old object
is left empty, safe to print) and the exception names it.

What the agreement cannot cover: a rank that fails before a collective the other ranks
are already in (expert names under expert parallelism) leaves them waiting there, as
any collective a rank skips does; the wrap's own collectives run before the split.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_hooks.setup.meta_init import local_of, set_local

__all__ = ["rollback_on_failure"]

_MODULE_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


@dataclass(frozen=True)
class _ParamRecord:
    param: nn.Parameter
    attrs: frozenset[str]
    grad_hooks: frozenset[int]
    meta: bool


def _readable(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` lies inside its storage (a freed bucket's storage
    is resized to 0). A DTensor (tensor parallelism): its local tensor."""
    if isinstance(t, DTensor):
        t = t.to_local()
    if t.device.type == "meta":
        return False
    if t.numel() == 0:
        return True
    end = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return t.untyped_storage().nbytes() >= (end + 1) * t.element_size()


class _Snapshot:
    def __init__(self, module: nn.Module, keep_values: bool) -> None:
        self.modules = list(module.modules())
        self.slots = [
            (m, name, p) for m in self.modules for name, p in m._parameters.items() if p is not None
        ]
        self.module_hooks = [
            (m, attr, set(getattr(m, attr)))
            for m in self.modules
            for attr in _MODULE_HOOK_DICTS
            if isinstance(getattr(m, attr, None), dict)
        ]
        self.params: dict[int, _ParamRecord] = {}
        for _m, _n, p in self.slots:
            hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
            self.params.setdefault(
                id(p), _ParamRecord(p, frozenset(vars(p)), frozenset(hooks), p.is_meta)
            )
        # The original value tensors, alive until the agreement (module note).
        self.kept: dict[int, torch.Tensor] = {}
        if keep_values:
            self.kept = {i: local_of(r.param) for i, r in self.params.items() if not r.meta}

    def restore(self) -> list[str]:
        """Put everything back; return the names of parameters whose values are lost."""
        for m, attr, keys in self.module_hooks:
            hooks = getattr(m, attr)
            for key in [k for k in hooks if k not in keys]:
                del hooks[key]
        for m, name, p in self.slots:
            m._parameters[name] = p
        names = {id(p): name for name, p in self.modules[0].named_parameters(remove_duplicate=True)}
        lost: dict[int, nn.Parameter] = {}
        for record in self.params.values():
            p = record.param
            for attr in set(vars(p)) - record.attrs:
                delattr(p, attr)
            hooks = getattr(p, "_post_accumulate_grad_hooks", None)
            if hooks:
                for key in [k for k in hooks if k not in record.grad_hooks]:
                    del hooks[key]
            p.grad = None
            with torch.no_grad():
                kept = self.kept.get(id(p))
                if kept is not None:
                    set_local(p, kept)
                elif record.meta or not _readable(p.data):
                    # A tensor cannot change device in place: a new meta Parameter takes
                    # the slots; the old object keeps an empty tensor (safe to print).
                    lost[id(p)] = nn.Parameter(
                        torch.empty(p.shape, dtype=p.dtype, device="meta"),
                        requires_grad=p.requires_grad,
                    )
                    p.data = p.data.new_empty(0)
                else:
                    p.data = p.data.clone()  # its own storage, not a view of a bucket
        for m, name, p in self.slots:
            if id(p) in lost:
                m._parameters[name] = lost[id(p)]
        return [names.get(i, "?") for i, rec in self.params.items() if i in lost and not rec.meta]


def _agree(failure: BaseException | None, group: Any) -> list[tuple[int, str]]:
    """``(rank, exception)`` of every rank of ``group`` whose wrap raised, the same list
    on every rank. A collective: every rank calls it once, failed or not."""
    mine = None if failure is None else f"{type(failure).__name__}: {failure}"
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [] if mine is None else [(dist.get_rank() if dist.is_initialized() else 0, mine)]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (dist.get_rank(), mine), group=group)
    return [(rank, what) for rank, what in everyone if what is not None]


@contextlib.contextmanager
def rollback_on_failure(
    module: nn.Module, group: Any = None, keep_values: bool = False
) -> Iterator[None]:
    """Run a wrap of ``module`` on every rank of ``group`` (None: the default group) and
    agree at its end; if it raised on any rank, restore the module on every rank (module
    note) and raise: the failed rank its own exception, with a note, the others a
    ``RuntimeError`` naming the failed ranks and their exceptions. ``keep_values``:
    keep the original value tensors alive until then (ZeRO-3)."""
    snapshot = _Snapshot(module, keep_values)
    failure: BaseException | None = None
    try:
        yield
    except BaseException as exc:
        failure = exc
    try:
        failed = _agree(failure, group)
    except BaseException as exc:  # the agreement itself failed: do not leave freed views
        snapshot.restore()
        raise RuntimeError(
            "fsdp: the ranks could not agree whether wrapping succeeded; this rank's "
            "module was restored"
        ) from (failure or exc)
    if not failed:
        return
    lost = snapshot.restore()
    where = "; ".join(f"rank {rank}: {what}" for rank, what in failed)
    restored = "every rank restored its module's original parameters, hooks and attributes"
    if lost:
        restored = (
            f"the values of {len(lost)} parameter(s) ({lost[:5]}) could not be restored "
            "on this rank and are now on the meta device (any use raises; rebuild or "
            "reload the module before wrapping it again); its other parameters, hooks and "
            "attributes are as before the wrap"
        )
    if failure is not None:
        failure.add_note(f"fsdp: wrapping failed on {where}; {restored}.")
        raise failure
    raise RuntimeError(f"fsdp: wrapping failed on another rank ({where}); {restored}.")
