"""What a backward gets for a unit weight saved under fsdp's saved-tensor hooks.

ZeRO-3 releases a unit's weights after its forward, so a weight that autograd saved for
backward is packed as a reference and gathered again when unpacked
(``FSDPHooks.saved_weights_hooks``): a gradient path that reaches the weights without
going through the unit's outputs (an auxiliary loss kept on the module, backpropagated
on its own) then reads the right weights instead of freed memory.

The catch, measured on torch 2.15: with any saved-tensor hooks, autograd hands a
backward a new tensor object for a saved parameter, even when the unpack hook returns the
parameter itself, and that object has none of the parameter's Python attributes. A
custom ``autograd.Function`` in the style of Megatron-Core's fused weight-gradient
accumulation reads ``weight.main_grad`` and sets ``weight.grad_added_to_main_grad`` on
the weight it saved: it raised (``main_grad``), or its flag was lost and its placeholder
weight gradient added on top of the real one (silently wrong).

So a weight unpacked for Python code (a custom Function's ``ctx.saved_tensors``) is a
``SavedParameter``: an alias of the parameter's storage whose ``__dict__`` is the
parameter's own, so reads and writes of attributes reach the parameter. Autograd
re-creates the unpacked tensor through ``detach``, which this class answers with
another alias sharing the same ``__dict__``; every other operation runs on the plain
alias (a ``__torch_dispatch__`` that unwraps), and returns plain tensors. The engine's
own nodes (C++, no Python caller) get the parameter itself: no dispatch cost there.
"""

from __future__ import annotations

import enum
import os
import sys
import types
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

__all__ = ["SavedParameter", "unpacked_for_python"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(__file__) + os.sep  # fsdp's hooks (composed unpack hooks)
# id(SavedParameter) -> its plain alias (not kept in __dict__: that is the parameter's).
_PLAIN: dict[int, torch.Tensor] = {}


class SavedParameter(torch.Tensor):
    """A saved parameter as a custom Function's backward sees it (module note)."""

    # Python-level ops must not re-wrap their results in this class.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def alias(plain: torch.Tensor, attrs: dict[str, Any]) -> SavedParameter:
        t = torch.Tensor._make_subclass(SavedParameter, plain, False)
        object.__setattr__(t, "__dict__", attrs)
        key = id(t)
        _PLAIN[key] = plain
        weakref.finalize(t, _PLAIN.pop, key, None)
        return t  # type: ignore[return-value]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is torch.ops.aten.detach.default and type(args[0]) is SavedParameter:
            # Autograd re-creates the unpacked tensor this way: keep the attributes.
            return SavedParameter.alias(_PLAIN[id(args[0])].detach(), args[0].__dict__)
        args, kwargs = tree_map_only(SavedParameter, _plain, (args, kwargs or {}))
        return func(*args, **kwargs)


def _plain(t: SavedParameter) -> torch.Tensor:
    return _PLAIN[id(t)]


def unpacked_for_python(param: torch.Tensor) -> torch.Tensor:
    """``param`` as an unpack hook should return it: a ``SavedParameter`` when it is a
    plain ``nn.Parameter`` and the code unpacking it is Python outside torch (a custom Function's backward reading
    ``ctx.saved_tensors``), else the parameter (the engine's nodes; torch's own Python,
    such as activation checkpointing)."""
    if type(param) is not nn.Parameter:  # a DTensor (tensor parallelism): as it is
        return param
    caller = sys._getframe(1)  # the unpack hook; who unpacks lies past fsdp's own frames
    while caller is not None and _kind(caller.f_code) is _Caller.OWN:
        caller = caller.f_back
    # No Python caller: the engine's device thread; torch's own Python: the engine's
    # run_backward frame (a C++ node) or checkpointing.
    if caller is None or _kind(caller.f_code) is _Caller.TORCH:
        return param
    return SavedParameter.alias(param.detach(), param.__dict__)


class _Caller(enum.Enum):
    OWN = "fsdp's hooks"
    TORCH = "torch"
    OTHER = "other Python: a custom Function's backward"


_KINDS: dict[types.CodeType, _Caller] = {}


def _kind(code: types.CodeType) -> _Caller:
    kind = _KINDS.get(code)
    if kind is None:
        name = code.co_filename
        kind = (
            _Caller.OWN
            if name.startswith(_OWN_DIR)
            else _Caller.TORCH
            if name.startswith(_TORCH_DIR)
            else _Caller.OTHER
        )
        _KINDS[code] = kind
    return kind
