"""The autograd plumbing of the unit hooks (``fsdp_hooks.runtime.backward``), one process.

``register_pre_backward`` calls back once per backward (graph task) at the first
gradient reaching any output; ``wrap_inputs_for_post_backward`` routes the inputs that
require grad through the post-backward function, whether they come as plain tensors (the
fast path) or inside containers and keyword arguments (pytree)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fsdp_hooks.runtime.backward import register_pre_backward, wrap_inputs_for_post_backward

# Runs on CUDA + NCCL under --fsdp-device cuda (root conftest.py).
pytestmark = pytest.mark.cuda


def test_pre_backward_once_per_backward_single_output():
    x = torch.randn(3, requires_grad=True)
    out = x * 2
    calls = []
    assert register_pre_backward(out, lambda: calls.append(1))
    out.sum().backward(retain_graph=True)
    assert len(calls) == 1
    out.sum().backward()  # a second graph task over the same graph
    assert len(calls) == 2


def test_pre_backward_once_per_backward_several_outputs():
    x = torch.randn(3, requires_grad=True)
    a, b = x * 2, x * 3
    calls = []
    # b twice (a tuple may repeat a tensor), a dict, a frozen output: one call a backward.
    output = (a, {"b": b, "again": b}, torch.zeros(1))
    assert register_pre_backward(output, lambda: calls.append(1))
    (a.sum() + b.sum()).backward(retain_graph=True)
    assert len(calls) == 1
    b.sum().backward()  # reaches one of them only
    assert len(calls) == 2


def test_pre_backward_nothing_to_hook():
    calls = []
    assert not register_pre_backward(torch.randn(2), lambda: calls.append(1))
    assert not register_pre_backward(("text", 3), lambda: calls.append(1))
    assert calls == []


def _check_routed(args, kwargs, needs_grad):
    calls = []
    new_args, new_kwargs = wrap_inputs_for_post_backward(lambda: calls.append(1), args, kwargs)
    assert isinstance(new_args, tuple) and isinstance(new_kwargs, dict)
    assert len(new_args) == len(args) and new_kwargs.keys() == kwargs.keys()
    for old, new in zip(args, new_args, strict=True):
        if isinstance(old, torch.Tensor) and old.requires_grad:
            assert new is not old and torch.equal(new, old)
        else:
            assert new is old
    loss = sum(t.sum() for t in new_args if isinstance(t, torch.Tensor) and t.requires_grad)
    for v in new_kwargs.values():
        loss = loss + v.sum()
    loss.backward()
    assert calls == [1]
    for t in needs_grad:
        assert t.grad is not None


def test_wrap_inputs_plain_tensors():
    x = torch.randn(2, 3, requires_grad=True)
    frozen = torch.randn(2, 3)
    _check_routed((x, frozen, x), {}, [x])


def test_wrap_inputs_containers_and_kwargs():
    @dataclasses.dataclass
    class Batch:
        h: torch.Tensor

    x = torch.randn(2, requires_grad=True)
    y = torch.randn(2, requires_grad=True)
    args = (x, Batch(y), 4)
    calls = []
    new_args, new_kwargs = wrap_inputs_for_post_backward(lambda: calls.append(1), args, {"y": y})
    assert new_args[0] is not x and new_args[1].h is not y and new_args[2] == 4
    assert new_kwargs["y"] is new_args[1].h  # one routed tensor per input tensor
    (new_args[0].sum() + new_kwargs["y"].sum()).backward()
    assert calls == [1]
    assert x.grad is not None and y.grad is not None


def test_wrap_inputs_nothing_requires_grad():
    args, kwargs = (torch.randn(2),), {}
    assert wrap_inputs_for_post_backward(lambda: None, args, kwargs) == (args, kwargs)
