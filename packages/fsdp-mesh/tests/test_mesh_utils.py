"""Module and signature helpers (single process); meshes are tested in test_distributed_index.py."""

import inspect

import pytest
from torch import nn

from fsdp_mesh import (
    contains_submesh,
    create_updated_function_signature,
    get_mesh_names,
    is_submodule,
)


def test_is_submodule():
    inner = nn.Linear(2, 2)
    block = nn.Sequential(inner, nn.ReLU())
    model = nn.Sequential(block, nn.Linear(2, 1))
    assert is_submodule(inner, model)
    assert is_submodule(block, model)
    assert not is_submodule(model, model)
    assert is_submodule(model, model, strict=False)
    assert not is_submodule(nn.Linear(2, 2), model)
    assert not is_submodule(model, block)


def test_no_mesh():
    assert get_mesh_names(None) == []
    assert not contains_submesh(None, "dp")


def _step(self, closure=None, *, scale: float = 1.0, **kwargs):
    return closure


def _plain(a, b=2):
    return a + b


def test_signature_adds_keyword_only_params():
    sig = create_updated_function_signature(_plain, sync=True, label=None)
    params = sig.parameters
    assert list(params) == ["a", "b", "sync", "label"]
    assert params["sync"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["sync"].default is True and params["sync"].annotation is bool
    assert params["label"].default is None
    assert params["label"].annotation is inspect.Parameter.empty

    def wrapper(*args, **kwargs):
        return _plain(*args)

    wrapper.__signature__ = sig
    assert str(inspect.signature(wrapper)) == "(a, b=2, *, sync: bool = True, label=None)"


def test_signature_keeps_var_keyword_last():
    sig = create_updated_function_signature(_step, zero_grad_buffer=True)
    assert list(sig.parameters) == ["self", "closure", "scale", "zero_grad_buffer", "kwargs"]
    bound = sig.bind(object(), zero_grad_buffer=False, extra=1)
    assert bound.arguments["zero_grad_buffer"] is False


def test_signature_of_bound_method_drops_self():
    opt = nn.Linear(1, 1)
    sig = create_updated_function_signature(opt.forward, flag=1)
    assert list(sig.parameters) == ["input", "flag"]


def test_signature_rejects_existing_names():
    with pytest.raises(ValueError, match=r"\['b'\].*already has parameters named \['a', 'b'\]"):
        create_updated_function_signature(_plain, b=3)
