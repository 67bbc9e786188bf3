"""What users do to parameters between steps, carried to the compute weights.

Outside forward and backward a wrapped module holds DTensor parameters (the optimizer's
main weights); forward and backward use compute parameters (views into buckets).
``ParamState`` keeps the two faithful to each other at each root forward:

- In-place writes (``p.mul_(0.5)``, an EMA copied back, a re-init under ``no_grad``) land
  in the main weights; their version counters move, and the next forward installs the
  main weights into the compute weights (``install_optimized_model_weights``), as an
  optimizer step does. Every rank must write alike (SPMD): under ZeRO-1/2 installing is
  an all-gather.
- ``requires_grad`` set on a DTensor parameter reaches its compute parameter: a frozen
  parameter gets no gradient (and ``.grad`` None, so optimizers skip it); a parameter
  that was frozen when wrapped has no gradient buffer, so making it trainable raises.
- Parameters that no backward reached since ``zero_grad`` on any rank get ``.grad``
  None, as in plain PyTorch (AdamW's weight decay then leaves them alone); their
  buckets are still reduced, so collectives stay matched across ranks.
"""

from __future__ import annotations

from operator import attrgetter

import torch
import torch.distributed as dist
from torch import nn

from fsdp_buffers import ParamAndGradBuffer
from fsdp_buffers.whole_param import inner_of, is_whole_parameter
from fsdp_hooks.runtime.config import RuntimeConfig
from fsdp_mesh.device import control_device

__all__ = ["ParamState"]

_version = attrgetter("_version")
_local_tensor = attrgetter("_local_tensor")
_requires_grad = attrgetter("requires_grad")


class ParamState:
    def __init__(
        self,
        buffer: ParamAndGradBuffer,
        distributed_by_compute: dict[nn.Parameter, nn.Parameter],
        config: RuntimeConfig,
    ) -> None:
        self._buffer = buffer
        names = {p: name for name, _g, _i, p in buffer.named_params()}
        # (name, compute, DTensor parameter, trainable bucket) in a rank-independent order.
        self.entries: list[tuple[str, nn.Parameter, nn.Parameter, bool]] = []
        for name, gid, _i, compute in buffer.named_params():
            dparam = distributed_by_compute[compute]
            self.entries.append((name, compute, dparam, buffer.groups[gid].requires_grad))
        self._names = names
        self._trainable = [(c, d) for _n, c, d, t in self.entries if t]
        self._expert = [
            bool(buffer.groups[buffer.group_of(c)[0]].is_expert_param) for c, _d in self._trainable
        ]
        self._inner = [inner_of(d) for _c, d in self._trainable]
        # For the checks run at every root forward (C-level maps, no call per parameter):
        # the tensors whose local shard has a counter of its own, and the requires_grad
        # pairs to compare.
        self._sharded = [d for d in self._inner if hasattr(d, "_local_tensor")]
        self._frozen_dparams = [d for _n, _c, d, t in self.entries if not t]
        self._trainable_compute = [c for c, _d in self._trainable]
        self._trainable_dparams = [d for _c, d in self._trainable]
        # Those whose hooks run_grad_hooks runs (a WholeParameter refuses every tensor op).
        self._hookable = [d for d in self._trainable_dparams if not is_whole_parameter(d)]
        self._trainable_ids = [id(c) for c in self._trainable_compute]
        self._versions: tuple[list[int], list[int]] = ([], [])
        # Where ``agree`` meets the other ranks, fixed at wrap: the device of its flags, the
        # data-parallel group, and the expert one when ranks hold different experts. A
        # group of one rank is left out (None): its own flags are the agreement, and with
        # no group left ``agree`` issues no collective and no device sync.
        self._device = control_device(buffer.device)
        index = config.dist_index
        dp_group = index.get_dp_group() if dist.is_initialized() else None
        expert_group = (
            index.get_dp_group(is_expert_parallel=True)
            if dp_group is not None and config.experts_differ_across_ranks and any(self._expert)
            else None
        )
        self._dp_group = _with_others(dp_group)
        self._expert_dp_group = _with_others(expert_group)
        # Experts' flags are agreed over the expert group, never the data-parallel one
        # (its other ranks hold other experts): their own where that group has one rank.
        self._expert_mask = (
            torch.tensor(self._expert, dtype=torch.bool, device=self._device)
            if expert_group is not None
            else None
        )
        # CUDA: the flags go to the device from this pinned tensor, without blocking the
        # host (made at the first agreement; its size, trainable parameters + buckets, is
        # fixed). ``agree``'s read of the result waits for that copy, so the next
        # agreement may refill it.
        self._pin = self._device.type == "cuda" and torch.cuda.is_available()
        self._staging: torch.Tensor | None = None
        # ids of the compute parameters a gradient reached (a Tensor hashes in Python;
        # the parameters live as long as the model).
        self.reached: set[int] = set()  # cleared, never replaced (the hooks bind .add)
        self.unreached: list[nn.Parameter] = []  # DTensor parameters whose .grad stays None
        self.record_versions()

    # ---- in-place writes ------------------------------------------------------------
    # Per trainable parameter, the DTensor's own counter (in-place ops on it) and its
    # local shard's, shared with the buffer it views (writes through ``p.data``, which
    # has a counter of its own); a WholeParameter's are its real tensor's (``inner_of``).
    # Only optimizers, installs and users write main weights between steps. Read twice
    # a step: C-level maps, no Python call per parameter. The local tensor is looked up
    # each time (not cached), so one swapped in under a DTensor is still seen.
    def _all_versions(self) -> tuple[list[int], list[int]]:
        return (
            list(map(_version, self._inner)),
            list(map(_version, map(_local_tensor, self._sharded))),
        )

    def record_versions(self) -> None:
        self._versions = self._all_versions()

    def main_weights_changed(self) -> bool:
        return self._all_versions() != self._versions

    # ---- requires_grad ----------------------------------------------------------------
    def sync_requires_grad(self) -> None:
        if not any(map(_requires_grad, self._frozen_dparams)) and list(
            map(_requires_grad, self._trainable_compute)
        ) == list(map(_requires_grad, self._trainable_dparams)):
            return  # nothing unfrozen, nothing to carry (the common case: C-level maps)
        unfrozen = [n for n, _c, d, trainable in self.entries if d.requires_grad and not trainable]
        if unfrozen:
            raise ValueError(
                f"parameters {unfrozen[:5]} were frozen (requires_grad=False) when the model was "
                "wrapped and have requires_grad=True now; fsdp gave them no gradient buffer. Set "
                "requires_grad before fully_shard (freeze later instead: that is honoured)."
            )
        for compute, dparam in self._trainable:
            if compute.requires_grad != dparam.requires_grad:
                compute.requires_grad_(dparam.requires_grad)

    # ---- parameters no backward reached ---------------------------------------------
    def clear(self) -> None:
        self.reached.clear()
        self.unreached = []

    def agree(self, late: list[bool]) -> list[bool]:
        """End of a backward, in one collective (a MAX over the data-parallel group; none
        when it has one rank): which trainable parameters got a gradient on some rank
        since ``zero_grad``, and which buckets some rank holds gradients for that arrived
        after their reduction (``late``, one flag per bucket in the reduce pipeline's
        order; returned agreed)."""
        reached = list(map(self.reached.__contains__, self._trainable_ids))
        if self._dp_group is not None or self._expert_dp_group is not None:
            n = len(reached)
            flags = self._on_device(reached + late)
            # Ranks hold different experts: theirs agree over the expert group instead.
            mine = flags[:n].clone() if self._expert_mask is not None else None
            if self._dp_group is not None:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._dp_group)
            if mine is not None:
                if self._expert_dp_group is not None:
                    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self._expert_dp_group)
                flags = torch.cat([torch.where(self._expert_mask, mine, flags[:n]), flags[n:]])
            agreed = flags.tolist()  # the one device-to-host read of the agreement
            reached, late = agreed[:n], [bool(x) for x in agreed[n:]]
        self.unreached = [
            d for (_c, d), hit in zip(self._trainable, reached, strict=True) if not hit
        ]
        self._buffer.views.drop_grads(self.unreached)
        return late

    def _on_device(self, flags: list[bool]) -> torch.Tensor:
        """``flags`` as uint8 on the agreement's device (CUDA: through the staging)."""
        host = torch.tensor(flags, dtype=torch.uint8)
        if not self._pin:
            return host.to(self._device)
        if self._staging is None or self._staging.numel() != host.numel():
            self._staging = torch.empty_like(host).pin_memory()
        return self._staging.copy_(host).to(self._device, non_blocking=True)

    def run_grad_hooks(self) -> None:
        """Once the reduced gradients are attached: the post-accumulate-grad hooks users
        registered on the parameters they see, once per parameter with a gradient, as
        FSDP2 runs them on its sharded parameters after the reduction (optimizer-in-
        backward code steps there). Autograd never runs them: those parameters are not
        in the graph, the compute parameters are."""
        for dparam in self._hookable:
            hooks = getattr(dparam, "_post_accumulate_grad_hooks", None)
            if hooks and dparam.grad is not None:
                for hook in tuple(hooks.values()):
                    hook(dparam)


def _with_others(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group``, or None when it has this rank alone (nothing to agree with)."""
    return group if group is not None and dist.get_world_size(group) > 1 else None
