"""Undo a wrap that raised: the module gets back its parameters, hooks and attributes.

Wrapping moves each parameter's storage into fsdp's buffers group by group (its
``.data`` becomes a view into a bucket, and the original tensor is freed at once, so
wrapping holds the model plus one group, not the model twice), registers hooks and tags
parameters. An exception after that (an allocation failing for a later group, a bad
option found late) used to leave parameters viewing buckets that were freed with the
half-built wrapper: printing one then read freed memory. ``rollback_on_failure`` puts
back every parameter object in its module slot, removes the hooks and attributes the
wrap added, and gives each parameter its own copy of its values, read from the bucket it
views where that bucket holds them (ZeRO-0/1/2, and every group not yet moved). A
parameter whose values exist on this rank only as its shard (ZeRO-3 model weights of an
already moved group) cannot be restored without the other ranks (a collective, which a
failure on some ranks only would hang): a meta-device parameter of its shape and dtype
takes its slots (any use raises; the old object is left empty, safe to print) and the
exception says so, naming them. Parameters that were on the meta device before the
wrap (``init_model_with_meta_device``) are put back there alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

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
    def __init__(self, module: nn.Module) -> None:
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
                if record.meta or not _readable(p.data):
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


@contextlib.contextmanager
def rollback_on_failure(module: nn.Module) -> Iterator[None]:
    """Run a wrap of ``module``; if it raises, restore the module (module note) and
    re-raise, with a note naming any parameter whose values could not be restored."""
    snapshot = _Snapshot(module)
    try:
        yield
    except BaseException as exc:
        lost = snapshot.restore()
        if lost:
            exc.add_note(
                f"fsdp: wrapping failed after the values of {len(lost)} parameter(s) "
                f"({lost[:5]}) had been split into shards across ranks; they could not be "
                "restored on this rank alone and are now on the meta device (any use "
                "raises). Rebuild or reload the module before wrapping it again; the "
                "module's other parameters, hooks and attributes are as before the wrap."
            )
        raise
