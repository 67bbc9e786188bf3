"""What the wrapper offers a wrapped Hugging Face ``transformers`` model: ``save_pretrained``
(consolidated, in transformers' own format) and ``generate`` (every forward routed through the
wrapper's, so units are gathered and released as in training).

They live beside the wrapper, not in ``integrations.huggingface``, because ``MegatronFSDP``'s
methods call them and a layer never imports one above it; ``from_pretrained`` (which wraps a
model) stays in the integration.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["generate", "import_transformers", "save_pretrained"]


class _Wrapper(Protocol):
    """The part of ``MegatronFSDP`` these functions use."""

    module: nn.Module

    def _root_call(self, fn: Any, args: tuple, kwargs: dict) -> Any: ...


def import_transformers() -> Any:
    try:
        import transformers
    except ImportError as e:  # optional client: the hf dependency group
        raise ImportError(
            "fsdp's Hugging Face support (from_pretrained, save_pretrained) needs transformers (>=5): install it (`uv sync --group hf` "
            "or `pip install 'transformers>=5' safetensors`)"
        ) from e
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise ImportError(
            f"fsdp's Hugging Face support needs transformers >= 5 (its checkpoint conversion "
            f"API); found {transformers.__version__}"
        )
    return transformers


def _full_state_dict(wrapper: _Wrapper) -> dict[str, torch.Tensor]:
    """Every entry of ``wrapper.module.state_dict()`` as a full tensor, on every rank
    (collectives in key order, the same on every rank)."""
    full: dict[str, torch.Tensor] = {}
    for name, value in wrapper.module.state_dict().items():
        if isinstance(value, DTensor):
            full[name] = value.full_tensor().cpu()
        else:
            full[name] = value.detach().cpu()
    return full


def save_pretrained(wrapper: _Wrapper, directory: str | os.PathLike[str], **kwargs: Any) -> None:
    """Write the wrapped transformers model as ``save_pretrained`` does (config,
    safetensors with transformers' on-disk names, sharded with an index past
    ``max_shard_size``), loadable by ``from_pretrained`` of either library. Collective:
    call it on every rank; rank 0 writes (it holds the consolidated model meanwhile).
    ``kwargs`` go to transformers' ``save_pretrained`` (``max_shard_size``, ...)."""
    import_transformers()
    full = _full_state_dict(wrapper)
    error: list[str | None] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            wrapper.module.save_pretrained(directory, state_dict=full, **kwargs)
        except Exception as e:
            error[0] = f"{type(e).__name__}: {e}"
    del full
    if dist.is_initialized():
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise RuntimeError(f"save_pretrained to {directory} failed on rank 0: {error[0]}")


def generate(wrapper: _Wrapper, *args: Any, **kwargs: Any) -> Any:
    """``wrapper.generate(...)``: the wrapped model's ``generate`` (a Hugging Face ``GenerationMixin``), every
    forward it makes run as the wrapper's forward does: parameters gathered unit by
    unit (ZeRO-3 included) and released after each step. Same tokens as the
    unwrapped model."""
    inner = wrapper.module
    generate = getattr(inner, "generate", None)
    if not callable(generate):
        raise AttributeError(
            f"{type(inner).__name__} has no generate(): MegatronFSDP.generate runs the "
            f"wrapped model's own (a transformers GenerationMixin)"
        )
    if "forward" in inner.__dict__:
        raise RuntimeError(
            f"{type(inner).__name__} has an instance attribute 'forward'; generate() "
            f"routes the model's forward through the wrapper by setting one"
        )
    original = inner.forward

    @functools.wraps(original)  # generate inspects forward's signature
    def forward(*a: Any, **k: Any) -> Any:
        return wrapper._root_call(original, a, k)

    inner.forward = forward
    try:
        return generate(*args, **kwargs)
    finally:
        del inner.forward
