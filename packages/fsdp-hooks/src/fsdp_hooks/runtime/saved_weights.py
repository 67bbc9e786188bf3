"""What a backward gets for a unit weight saved under fsdp's saved-tensor hooks.

Under ``regather_saved_weights=True`` (``param_swap``) a unit weight that
autograd saves in forward is packed as a reference and gathered again when unpacked
after ZeRO-3 released it: a gradient path that reaches the weights without going
through the unit's outputs (an auxiliary loss kept on the module, backpropagated on its
own) then reads the right weights instead of freed memory.

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
alias (a ``__torch_dispatch__`` that unwraps), and returns plain tensors. Who gets
which is decided by the autograd node unpacking it (``torch._C._current_autograd_node``),
never by the caller's frames: a node implemented in Python (a custom Function's
``BackwardCFunction``), or Python code reading a saved tensor outside the engine, gets the
alias; the engine's own C++ nodes get the parameter itself (no dispatch cost there).

Only under ``regather_saved_weights=True`` (``param_swap``): without saved-tensor
hooks autograd hands every backward the parameter itself, attributes included.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.autograd.function import BackwardCFunction
from torch.utils._pytree import tree_map_only

__all__ = ["SavedParameter", "unpacked_for_python"]

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
    plain ``nn.Parameter`` and the node unpacking it is implemented in Python (a custom
    Function's backward reading ``ctx.saved_tensors``) or there is none (Python code
    reading a saved tensor outside backward); else (the engine's C++ nodes) the
    parameter. A DTensor (tensor parallelism) is returned as it is."""
    if type(param) is not nn.Parameter:
        return param
    node = torch._C._current_autograd_node()
    if node is not None and not isinstance(node, BackwardCFunction):
        return param
    return SavedParameter.alias(param.detach(), param.__dict__)
