"""Device and backend helpers, and warn_once."""

import warnings

import pytest
import torch

from fsdp_mesh import backend_for_device, current_device, default_device_type
from fsdp_mesh.device import warn_once, warn_once_each


def test_default_device_type_follows_cuda_availability():
    assert default_device_type() == ("cuda" if torch.cuda.is_available() else "cpu")


def test_backend_for_device():
    assert backend_for_device("cpu") == "gloo"
    assert backend_for_device("cuda") == "nccl"
    with pytest.raises(ValueError, match=r"device type 'xpu'.*\['cpu', 'cuda'\]"):
        backend_for_device("xpu")


def test_current_device():
    assert current_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="Unsupported device type 'meta'"):
        current_device("meta")
    if torch.cuda.is_available():
        assert current_device("cuda") == torch.device("cuda", torch.cuda.current_device())
    else:
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            current_device("cuda")


def test_warn_once_warns_once_per_key():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert warn_once("test_device.key-a", "option ignored on CPU") is True
        assert warn_once("test_device.key-a", "option ignored on CPU") is False
        assert warn_once("test_device.key-b", "another option ignored") is True
    assert [str(w.message) for w in caught] == ["option ignored on CPU", "another option ignored"]
    assert all(w.category is UserWarning for w in caught)


def test_warn_once_each_names_only_new_keys_in_one_warning():
    def message(new):
        return "ignored: " + ", ".join(new)

    keys = ["test_device.each-a", "test_device.each-b"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert warn_once_each(keys, message) == keys
        assert warn_once_each(keys, message) == []
        assert warn_once_each([*keys, "test_device.each-c"], message) == ["test_device.each-c"]
        assert warn_once_each([], message) == []
    assert [str(w.message) for w in caught] == [
        "ignored: test_device.each-a, test_device.each-b",
        "ignored: test_device.each-c",
    ]


def _gloo_on_a_cuda_machine():
    from unittest import mock

    import torch.distributed as dist

    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        return dist.get_backend(), default_device_type()


def test_default_device_type_follows_the_process_group_backend():
    """A gloo group communicates CPU tensors even where CUDA is usable: the default
    device (of fully_shard's and the adapters' meshes) is then the CPU."""
    from fsdp_mesh.testing import run_distributed

    assert run_distributed(_gloo_on_a_cuda_machine, 1) == [("gloo", "cpu")]
