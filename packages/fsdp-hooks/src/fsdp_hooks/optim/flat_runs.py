"""Flat runs: a group's adjacent local shards stepped as one tensor by the local step.

Note [flat runs]: on the local step (Note [local step]), an element-wise optimizer's
host time grows with the number of tensors it steps (CPU's single-tensor loop runs ~10
ops per parameter; ``foreach`` kernels loop per tensor too), and a many-small-parameter
model has hundreds. But the local shards of one bucket's parameters are adjacent views
of one main-weight storage, their gradients of one main-grad storage (Note [shard
layout]: regions back to back, unless a rank holds fewer rows than the region's width).
A *run* is a maximal sequence of consecutive parameters of one group whose weights,
gradients and per-element state each follow one another in one storage, with equal
scalar state (``step``, ...): the step then updates one flat view per run instead of
one tensor per member, which is exact because the update is element-wise given the
group's options and the scalar state (the same for every member). Floating-point
results may differ from per-tensor stepping in the last bit where a member's elements
fall on a different vector boundary; they are the same update.

- A run holds ``RUN_MAX_NUMEL`` elements at most: the update's temporaries are the
  size of the tensor stepped.
- State is *born flat*: a run's first step (no state yet) creates it on the flat shadow,
  and each member's state is written back as DTensors over views of it
  (``split_flat``). State that arrives otherwise (loaded, or created before runs could
  form) is *re-homed* once, when a run is planned: each key gets one flat allocation per
  run, the members' values are copied in, and each member's local tensor is pointed
  into it with ``set_`` (the same tensor objects, so DTensor state, ``state_dict()`` and
  DCP see no difference). Re-homing frees the old pieces, which an allocator keeps for
  later use (RSS, CUDA's reserved memory), so the common path avoids it.
- Each scalar key's members (over every run of the plan) are likewise pointed into one
  tensor ``S``; a run's step updates its first member's scalar, and after the step one
  copy broadcasts it to the rest of the run. Before each step one comparison checks that
  the members still agree (a user may write one in place); if not, the plan is rebuilt
  and the run splits where the values differ.
- Every step checks, with C-level maps, that each member tensor still lies where the run
  expects (fsdp re-points gradient views at new storage when a bucket's gradient buffer
  is released and allocated again): the flat views are re-pointed when the members
  moved together, and the plan is rebuilt when they no longer follow one another. The
  flat gradient is made for each step and dropped after it, so that it keeps no
  released gradient storage alive.
- Each member's weight has a version counter of its own (``ParamState`` reads them to
  see in-place writes, and installs what a step wrote without installing); writes
  through the flat view move the view's, so the members' are incremented after the
  step (one call).

Under ZeRO-1/2 the main weights are the local rows of the unsharded compute buffer (one
rank's pieces of consecutive parameters are apart), so no run forms and those steps stay
one tensor per parameter; copying them into a flat tensor and back would cost a shard
of memory during the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import sub
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import increment_version

__all__ = ["FlatRun", "Member", "RunLayout", "ScalarStore", "find_runs", "split_flat"]

_data_ptr = torch.Tensor.data_ptr
_is_contiguous = torch.Tensor.is_contiguous
_numel = torch.Tensor.numel

RUN_MAX_NUMEL = 1 << 20
"""Elements in a flat run at most. A step's temporaries (CPU's single-tensor update
allocates a few the size of the tensor it steps) then stay within what stepping a
parameter of that size takes, and a tensor this large costs far more to step than the
per-tensor overhead a run saves (Note [flat runs])."""


class Member:
    """One parameter as a run sees it: the parameter (whose state is written back), its
    local weight, gradient and handed state (the local tensors of its real state, Note
    [local step])."""

    __slots__ = ("grad", "param", "state", "weight")

    def __init__(
        self, param: Any, weight: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]
    ) -> None:
        self.param, self.weight, self.grad, self.state = param, weight, grad, state


def _follows(prev: torch.Tensor, nxt: torch.Tensor) -> bool:
    """``nxt`` is the contiguous stretch right after ``prev`` in the same storage."""
    return (
        nxt.dtype == prev.dtype
        and nxt.device == prev.device
        and nxt.is_contiguous()
        and prev.is_contiguous()
        and nxt.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
        and nxt.storage_offset() == prev.storage_offset() + prev.numel()
    )


def _scalar_like(a: Any, b: Any) -> bool:
    """Two scalar state values a run can share: 0-d tensors alike and equal."""
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.ndim == 0
        and b.ndim == 0
        and a.dtype == b.dtype
        and a.device == b.device
        and a is not b
        and bool(torch.equal(a, b))
    )


def _joins(first: Member, prev: Member, nxt: Member, per_element: frozenset[str]) -> bool:
    if not (_follows(prev.weight, nxt.weight) and _follows(prev.grad, nxt.grad)):
        return False
    state, head = nxt.state, first.state
    if state.keys() != head.keys():
        return False
    for key, value in state.items():
        ref = head[key]
        if key in per_element:
            if not (
                value.dtype == ref.dtype
                and value.device == ref.device
                and value.is_contiguous()
                and value is not prev.state[key]
            ):
                return False
        elif not _scalar_like(ref, value):
            return False
    return True


def find_runs(
    members: Sequence[Member | None],
    per_element: frozenset[str],
    max_numel: int = RUN_MAX_NUMEL,
) -> list[range]:
    """The runs (two members or more, ``max_numel`` elements at most) among ``members``
    in order; None breaks a run (a parameter without a gradient: the step skips it)."""
    runs: list[range] = []
    start, numel = 0, 0
    for i in range(1, len(members) + 1):
        nxt = members[i] if i < len(members) else None
        prev = members[i - 1]
        first = members[start]
        if prev is not None:
            numel += prev.weight.numel()
        if (
            nxt is not None
            and prev is not None
            and first is not None
            and numel + nxt.weight.numel() <= max_numel
            and _joins(first, prev, nxt, per_element)
        ):
            continue
        if i - start >= 2 and first is not None:
            runs.append(range(start, i))
        start, numel = i, 0
    return runs


def _point(view: torch.Tensor, first: torch.Tensor, numel: int) -> torch.Tensor:
    """``view`` pointed at ``numel`` elements of ``first``'s storage from ``first`` on,
    flat (``set_`` checks the bounds against the storage)."""
    return view.set_(first.untyped_storage(), first.storage_offset(), (numel,), (1,))


def _span(first: torch.Tensor, numel: int) -> torch.Tensor:
    """A flat tensor over ``numel`` elements from ``first`` on, of its own (not a view: a
    version counter of its own, re-pointable with ``set_``; ``dtensor_views._own`` makes
    the same kind over a view's own extent). It does not require grad, so no ``no_grad``
    is needed, whose context costs more than the rest once per run and step."""
    return _point(torch.empty(0, dtype=first.dtype, device=first.device), first, numel)


def split_flat(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` (one element per element of ``like``, back to back) as tensors shaped as
    ``like``'s, each of its own over ``flat``'s storage; raises when ``flat`` is not such
    a tensor."""
    numel = sum(map(_numel, like))
    if not (isinstance(flat, torch.Tensor) and flat.shape == (numel,) and flat.is_contiguous()):
        raise RuntimeError(
            f"{type(flat).__name__} {tuple(getattr(flat, 'shape', ()))} came out of a local "
            f"step over a flat run of {numel} elements as per-element optimizer state; its "
            "update may not be element-wise (report it; fsdp_hooks.optim.local_step lists the "
            "optimizers stepped locally)"
        )
    storage, offset, out = flat.untyped_storage(), flat.storage_offset(), []
    for t in like:
        piece = torch.empty(0, dtype=flat.dtype, device=flat.device)
        out.append(piece.set_(storage, offset, t.shape, t.stride()))
        offset += t.numel()
    return out


@torch.no_grad()
def _rehome(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat tensor over ``tensors`` (contiguous, alike), which become views of it:
    the span they already form when they follow one another, else a new allocation they
    are copied into and pointed at (``set_``: the same objects)."""
    numel = sum(map(_numel, tensors))
    if all(map(_follows, tensors, tensors[1:])):
        return _span(tensors[0], numel)
    flat = torch.empty(numel, dtype=tensors[0].dtype, device=tensors[0].device)
    torch.cat([t.reshape(-1) for t in tensors], out=flat)
    for t, piece in zip(tensors, split_flat(flat, tensors), strict=True):
        t.set_(piece)
    return flat


class FlatRun:
    """Consecutive parameters of one group stepped as one flat tensor (Note [flat runs]).

    ``chains``: the members' tensors of each persistent kind (weights, each per-element
    state key), ``views`` the flat tensor over each chain, in the same order; ``grads``:
    the members' gradients, whose flat view is made for each step only (a view kept
    would keep a released gradient storage alive)."""

    __slots__ = (
        "chains",
        "grads",
        "handed",
        "numel",
        "params",
        "scalar_chains",
        "shadow",
        "views",
        "weights",
    )

    def __init__(self, members: list[Member], per_element: frozenset[str], requires_grad: bool):
        self.params = [m.param for m in members]
        self.weights = weights = [m.weight for m in members]
        self.numel = sum(map(_numel, weights))
        self.grads = [m.grad for m in members]
        self.shadow = nn.Parameter(_span(weights[0], self.numel), requires_grad=requires_grad)
        self.chains, self.views = [weights], [self.shadow]
        # The shadow state: a flat tensor per per-element key, the first member's scalars
        # (ScalarStore points every member's into one tensor and broadcasts after).
        self.handed: dict[str, Any] = {}
        self.scalar_chains: dict[str, list[torch.Tensor]] = {}
        for key, value in members[0].state.items():
            chain = [m.state[key] for m in members]
            if key in per_element:
                self.handed[key] = _rehome(chain)
                self.chains.append(chain)
                self.views.append(self.handed[key])
            else:
                self.handed[key] = value
                self.scalar_chains[key] = chain

    def grad(self) -> torch.Tensor:
        """The flat gradient, over where the members' gradients lie now."""
        return _span(self.grads[0], self.numel)

    @torch.no_grad()
    def follow(self) -> None:
        """Point the flat tensors at where their chains lie now (they moved together)."""
        for view, chain in zip(self.views, self.chains, strict=True):
            _point(view, chain[0], self.numel)


class ScalarStore:
    """One scalar key's 0-d tensors over every run of a plan, pointed into one tensor
    ``values``; ``lead[i]`` is the position of member ``i``'s run's first member."""

    __slots__ = ("lead", "values")

    @torch.no_grad()
    def __init__(self, runs: list[list[torch.Tensor]]) -> None:
        tensors = [t for run in runs for t in run]
        if len(set(map(id, tensors))) != len(tensors):
            raise ValueError("a scalar state tensor is shared by two parameters")
        self.values = torch.stack(tensors)
        storage = self.values.untyped_storage()
        for i, t in enumerate(tensors):
            t.set_(storage, i, (), ())
        lead: list[int] = []
        for run in runs:
            lead += [len(lead)] * len(run)
        self.lead = torch.tensor(lead, dtype=torch.long, device=self.values.device)

    def agree(self) -> bool:
        """Every member still equals its run's first (no one wrote one in place)."""
        return bool(torch.equal(self.values, self.values.index_select(0, self.lead)))

    def broadcast(self) -> None:
        """Each run's first member's value (the one the step updated) to the rest."""
        self.values.copy_(self.values.index_select(0, self.lead))


class RunLayout:
    """Where every run's member tensors lay when last checked, to tell each step with
    C-level maps whether the flat tensors still cover them (Note [flat runs]).

    The persistent chains (weights, per-element state) stay where they are: their
    locations are compared with the recorded ones, and when they all moved together the
    flat views follow. Gradients move whenever fsdp allocates a bucket's gradient buffer
    anew (every step under ZeRO-2/3): each step checks that they still follow one
    another (contiguous, each member right after the one before), and the flat gradient
    is made over them for the step. Anything else: plan anew."""

    __slots__ = ("chains", "grads", "runs", "views", "weights")

    def __init__(self, runs: list[FlatRun]) -> None:
        self.runs = runs
        self.chains = _Chains([chain for run in runs for chain in run.chains])
        self.grads = _Chains([run.grads for run in runs])
        self.views = [view for run in runs for view in run.views]
        self.weights = [w for run in runs for w in run.weights]

    def bump_versions(self) -> None:
        """The members' own version counters, moved as a per-member step moves them (a
        flat shadow has a counter of its own): one call for every run."""
        increment_version(self.weights)

    def current(self) -> bool:
        """True when the flat tensors cover their members (the views re-pointed if the
        persistent members all moved together); False when the members no longer
        follow one another."""
        if not self.grads.follow_one_another():
            return False
        chains = self.chains
        ptrs = chains.ptrs_now()
        if ptrs == chains.ptrs and list(map(_data_ptr, self.views)) == chains.firsts_of(ptrs):
            return True
        if not chains.follow_one_another(ptrs):
            return False
        try:
            for run in self.runs:
                run.follow()
        except RuntimeError:  # past the first member's storage: not one allocation
            return False
        return True


class _Chains:
    """Chains of tensors, each expected to follow one another in one storage: their
    locations when last checked, and the byte distance between consecutive members."""

    __slots__ = ("deltas", "firsts", "next", "prev", "ptrs", "tensors")

    def __init__(self, chains: list[list[torch.Tensor]]) -> None:
        self.tensors = [t for chain in chains for t in chain]
        prev: list[int] = []
        firsts: list[int] = []
        deltas: list[int] = []
        at = 0
        for chain in chains:
            firsts.append(at)
            for i in range(1, len(chain)):
                prev.append(at + i - 1)
                deltas.append(chain[i - 1].numel() * chain[i - 1].element_size())
            at += len(chain)
        self.prev, self.next = prev, [i + 1 for i in prev]
        self.firsts, self.deltas = firsts, deltas
        self.ptrs = self.ptrs_now()

    def ptrs_now(self) -> list[int]:
        return list(map(_data_ptr, self.tensors))

    def firsts_of(self, ptrs: list[int]) -> list[int]:
        return list(map(ptrs.__getitem__, self.firsts))

    def follow_one_another(self, ptrs: list[int] | None = None) -> bool:
        """Each chain's members still follow one another (at ``ptrs``, or where they
        lie now); recorded as the new locations when they do."""
        if ptrs is None:
            ptrs = self.ptrs_now()
            if ptrs == self.ptrs:
                return True
        at = ptrs.__getitem__
        if list(map(sub, map(at, self.next), map(at, self.prev))) != self.deltas or not all(
            map(_is_contiguous, self.tensors)
        ):
            return False
        self.ptrs = ptrs
        return True
