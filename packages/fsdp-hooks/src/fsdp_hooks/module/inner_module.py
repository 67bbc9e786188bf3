"""``InnerModuleAttributes``: a wrapper module resolves the wrapped module's attributes.

``MegatronFSDP`` and the Megatron-Core style adapters hold the user's module as their
submodule ``module``. As with FSDP1's wrapper (and FSDP2, which shards in place),
``wrapper.config``, ``wrapper.generate(...)`` or ``wrapper.model.layers`` then reach the
wrapped module: an attribute the wrapper does not have (as nn.Module resolves it:
its own attributes, parameters, buffers and submodules first) is looked up on
``wrapper.module``, so a method comes back bound to the wrapped module.

``named_parameters()`` and ``named_buffers()`` give the names ``state_dict()`` gives
(the wrapped module's, without the ``module.`` levels of wrappers), as FSDP2's
in-place sharding does, and ``_fqn_modifiers`` tells ``torch.distributed.checkpoint.state_dict`` that the
``module`` level does not appear in state-dict keys (our ``state_dict()`` uses the
wrapped module's names), so its ``get_state_dict``/``set_state_dict`` map parameters
and optimizer state to those names.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["InnerModuleAttributes"]

INNER = "module"


class InnerModuleAttributes(nn.Module):
    """Base for wrappers that hold the wrapped module as ``self.module``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # Read through __dict__: during __init__ (before ``module`` is set) and while
            # unpickling, ``_modules`` may not exist yet; dunders (copy/pickle protocol
            # probes) are never forwarded.
            modules = self.__dict__.get("_modules")
            inner = modules.get(INNER) if modules is not None else None
            if inner is None or name == INNER or name.startswith("__"):
                raise
            try:
                return getattr(inner, name)
            except AttributeError as inner_error:
                raise AttributeError(
                    f"'{type(self).__name__}' object has no attribute '{name}', nor has "
                    f"the module it wraps: {inner_error}"
                ) from None

    def _fqn_modifiers(self) -> dict[str, str]:
        """Every top-level name of the wrapped module's state, mapped to the level that
        state-dict keys skip (``module``); see torch's ``_get_fqns``."""
        inner = self._modules.get(INNER)
        if inner is None:
            return {}
        names = {*inner._modules, *inner._parameters, *inner._buffers}
        names.add(nn.modules.module._EXTRA_STATE_KEY_SUFFIX)
        return {name: INNER for name in names}

    def _wrapper_depth(self) -> int:
        depth, inner = 1, self._modules.get(INNER)
        while isinstance(inner, InnerModuleAttributes):
            depth, inner = depth + 1, inner._modules.get(INNER)
        return depth

    def _state_name(self, name: str, prefix: str) -> str:
        head = f"{prefix}." if prefix else ""
        rest = name[len(head) :]
        for _ in range(self._wrapper_depth()):
            if not rest.startswith(INNER + "."):
                break
            rest = rest[len(INNER) + 1 :]
        return head + rest

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            yield self._state_name(name, prefix), p

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Any]]:
        for name, b in super().named_buffers(prefix, recurse, remove_duplicate):
            yield self._state_name(name, prefix), b
