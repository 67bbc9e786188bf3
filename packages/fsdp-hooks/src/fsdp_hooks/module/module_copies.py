"""What a wrapped model does with ``copy.deepcopy`` and dtype casts.

Its parameters are shards of buffers that the collectives, the hooks and the optimizer
share, so neither a deep copy nor a cast of them alone can give a working model. Both
are refused with a message saying what to do instead, as FSDP2 refuses deepcopy
(``torch.optim.swa_utils.AveragedModel`` deep-copies its model, so it is refused the
same way). A cast or a move to another device is refused at the call, before any
tensor changes (converting the buffers consistently is not implemented); a move to the
device the model is on and a cast to the dtypes it already has change nothing, and
are no-ops (``nn.Module._apply`` would otherwise replace the DTensor parameters by
new ones without fsdp's attributes). One exception: ``model.to_empty(device=...)`` after
wrapping a meta model (FSDP2's route, Note [the model's init_weights] in ``meta_init``)
materializes the module buffers still on the meta device; the parameters are in fsdp's
buffers already.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["DEEPCOPY_REFUSED", "check_unchanged", "materialize_meta_buffers"]

DEEPCOPY_REFUSED = (
    "fsdp: copy.deepcopy of an fsdp-wrapped model is not supported (its parameters are "
    "shards of buffers shared with the collectives, the hooks and the optimizer; FSDP2 "
    "refuses deepcopy too). torch.optim.swa_utils.AveragedModel deep-copies its model: "
    "keep an average of the weights instead over model.state_dict() (DTensors: "
    "ema = {k: v.detach().clone() for k, v in model.state_dict().items()}, updated under "
    "torch.no_grad() with ema[k].lerp_(v, 1 - decay), saved with fsdp's save_checkpoint "
    "as a model or with torch.distributed.checkpoint), or deep-copy the module before "
    "wrapping and wrap the copy too"
)


def check_unchanged(model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Raise ``NotImplementedError`` unless ``model._apply(fn)`` would leave the dtype
    and device of every floating parameter and buffer as they are: ``fn`` is tried on
    an empty tensor of each dtype and device the model holds (the model is not
    touched)."""
    kinds = {
        (t.dtype, t.device)
        for t in (*model.parameters(), *model.buffers())
        if t.dtype.is_floating_point
    }
    changed = []
    for dtype, device in sorted(kinds, key=str):
        result = fn(torch.empty(0, dtype=dtype, device=device))
        if isinstance(result, torch.Tensor) and (result.dtype, result.device) != (dtype, device):
            changed.append(f"{dtype} on {device} -> {result.dtype} on {result.device}")
    if changed:
        raise NotImplementedError(
            f"fsdp: casting or moving a wrapped model's tensors ({', '.join(changed)}) is not "
            "supported: its parameters are shards of buffers allocated at wrap, on its "
            "device, in the dtypes its MixedPrecisionPolicy gives (main weights, compute "
            "weights, gradients). Cast or move the module before wrapping (module.to(dtype) "
            "or module.to(device), then fully_shard), or keep the weights and set "
            "MixedPrecisionPolicy(param_dtype=...) for the compute dtype. Nothing was "
            "changed"
        )


def materialize_meta_buffers(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace each buffer of ``module`` on the meta device by ``fn`` of it (shared ones
    once) where ``fn`` gives a tensor off the meta device in the same dtype (``to_empty``
    does); a cast, or a move that cannot take a meta tensor, is left to
    ``check_unchanged`` and torch."""
    made: dict[int, torch.Tensor] = {}
    for mod in module.modules():
        for attr, b in mod._buffers.items():
            if b is None or not b.is_meta:
                continue
            new = made.get(id(b))
            if new is None:
                new = fn(b)
                if not isinstance(new, torch.Tensor) or new.is_meta or new.dtype != b.dtype:
                    return
                made[id(b)] = new
            mod._buffers[attr] = new
