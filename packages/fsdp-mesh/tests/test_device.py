"""Device and backend helpers, and warn_once."""

import warnings

import pytest
import torch

from fsdp_mesh import backend_for_device, current_device, default_device_type, warn_once


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
