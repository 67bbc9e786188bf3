"""The gradient hooks of ``DistributedDataParallel``: feed each gradient to the reduce
pipeline as backward produces it, and check for NaN/Inf when asked.

Per backward: the first gradient hook queues an end-of-backward callback and decides
whether this backward reduces (``overlap_grad_reduce`` and not inside ``no_sync``).
Every hook moves ``param.grad`` into ``param.main_grad`` (or, when the module already
added into ``main_grad`` and set ``param.grad_added_to_main_grad``, drops it), and a
bucket whose gradients are all in is reduced at once when this backward reduces. The
end-of-backward callback launches what is left (zeros stand in for gradients that never
came, so every rank issues the same collectives) and waits; when this backward does
not reduce, gradients stay accumulated for ``finish_grad_sync``.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from fsdp_buffers import GradReducePipeline, ParamAndGradBuffer
from fsdp_hooks.runtime.backward import queue_end_of_backward_callback
from fsdp_hooks.runtime.hooks import raise_if_nonfinite_on_any_rank

__all__ = ["DDPGradHooks"]


class DDPGradHooks:
    def __init__(
        self,
        buffer: ParamAndGradBuffer,
        pipeline: GradReducePipeline,
        *,
        overlap_grad_reduce: bool,
        check_for_nan_in_grad: bool,
    ) -> None:
        self.buffer = buffer
        self.pipeline = pipeline
        self.overlap_grad_reduce = overlap_grad_reduce
        self.check_for_nan_in_grad = check_for_nan_in_grad
        self.sync_enabled = True  # False inside no_sync()
        self._callback_queued = False
        self._nonfinite: list[tuple[str, torch.Tensor]] = []
        self._names = {p: name for name, _gid, _i, p in buffer.named_params()}
        self_ref = weakref.ref(self)

        def on_grad(param: torch.Tensor) -> None:
            hooks = self_ref()
            if hooks is not None:
                hooks._on_grad(param)

        for group in buffer.groups:
            if not group.requires_grad:
                continue
            for p in group.params:
                p.grad_added_to_main_grad = False  # type: ignore[attr-defined]
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(on_grad)

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            self.pipeline.sync_grads = self.sync_enabled and self.overlap_grad_reduce
            queue_end_of_backward_callback(self._end_of_backward)
        if self.check_for_nan_in_grad:
            fused = getattr(param, "grad_added_to_main_grad", False)
            local = param.main_grad if fused else param.grad  # type: ignore[attr-defined]
            if local is not None:
                # Kept as a tensor: checking now would sync the device once per parameter.
                self._nonfinite.append((self._names[param], torch.isfinite(local).all()))
        self.pipeline.mark_param_grad_ready(param)  # type: ignore[arg-type]

    def _end_of_backward(self) -> None:
        try:
            self.pipeline.finish()
        finally:
            self._callback_queued = False

    def clear_nonfinite(self) -> None:
        self._nonfinite.clear()

    def raise_if_nonfinite(self, group: dist.ProcessGroup) -> None:
        """Agree across ``group`` whether any rank saw a NaN/Inf local gradient since
        the last call; if one did, raise on every rank naming the parameters and ranks."""
        if not self.check_for_nan_in_grad:
            return
        raise_if_nonfinite_on_any_rank(
            self._nonfinite, group, self.buffer.device, "check_for_nan_in_grad"
        )
