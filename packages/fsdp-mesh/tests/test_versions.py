"""Transformer Engine version checks read metadata only and never raise when TE is absent;
torch's version checks read ``torch.__version__``."""

import sys
from importlib import metadata

import pytest
import torch

from fsdp_mesh import (
    ReleaseVersion,
    get_te_version,
    get_torch_version,
    is_te_min_version,
    is_torch_min_version,
    parse_version,
)
from fsdp_mesh.versions import dtensor_masked_assign_keeps_shard


@pytest.fixture
def te_installed(monkeypatch):
    """Pretend the given distribution name is installed at the given version."""

    def install(version: str | None, dist_name: str = "transformer-engine"):
        real = metadata.version

        def fake_version(name):
            if name in ("transformer-engine", "transformer_engine"):
                if version is not None and name == dist_name:
                    return version
                raise metadata.PackageNotFoundError(name)
            return real(name)

        monkeypatch.setattr(metadata, "version", fake_version)
        get_te_version.cache_clear()

    yield install
    get_te_version.cache_clear()


def test_absent(te_installed):
    te_installed(None)
    assert get_te_version() is None
    assert is_te_min_version("1.0") is False
    assert is_te_min_version("0.0.1", check_equality=False) is False
    assert "transformer_engine" not in sys.modules


@pytest.mark.parametrize("dist_name", ["transformer-engine", "transformer_engine"])
def test_present(te_installed, dist_name):
    te_installed("2.8.0.dev0+cu12abc", dist_name)
    version = get_te_version()
    assert version == ReleaseVersion((2, 8), final=False)
    assert str(version) == "2.8.0.dev0+cu12abc"
    assert is_te_min_version("2.7")
    assert is_te_min_version("1.5.0")
    assert not is_te_min_version("2.8")  # a dev build precedes its release
    assert not is_te_min_version("2.9.0", check_equality=False)
    assert "transformer_engine" not in sys.modules


def test_equality_flag(te_installed):
    te_installed("2.1.0")
    assert is_te_min_version("2.1")
    assert not is_te_min_version("2.1", check_equality=False)
    assert is_te_min_version("2.0.9", check_equality=False)


def test_result_is_cached(te_installed, monkeypatch):
    te_installed("1.13.0")
    assert get_te_version() == "1.13"
    te_installed("2.0.0")  # clears the cache
    assert get_te_version() == "2.0"
    calls = []
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: calls.append(name) or real(name))
    assert get_te_version() == "2.0"
    assert calls == []


def test_unparseable_metadata_reads_as_absent(te_installed):
    te_installed("not-a-version")
    assert get_te_version() is None
    assert is_te_min_version("1.0") is False


@pytest.mark.parametrize(
    ("smaller", "larger"),
    [
        ("1.9", "1.10"),
        ("2.0rc1", "2.0"),
        ("2.0.0.dev0", "2.0.0"),
        ("v1.2.3", "1.2.4"),
        ("2.0", "2.0.0.1"),
    ],
)
def test_ordering(smaller, larger):
    assert parse_version(smaller) < parse_version(larger)
    assert parse_version(larger) > smaller
    assert parse_version(smaller) != parse_version(larger)


def test_parse_normalises_and_rejects():
    assert parse_version("2.0") == parse_version("2.0.0")
    assert hash(parse_version("2.0")) == hash(parse_version("2.0.0+local"))
    assert parse_version("2.0+cu12").final
    with pytest.raises(ValueError, match="Cannot parse version 'abc'"):
        parse_version("abc")


def test_torch_version_reads_the_running_torch():
    assert get_torch_version() == parse_version(torch.__version__.split("+")[0])
    assert is_torch_min_version("2.11")  # the oldest torch the packages declare
    assert not is_torch_min_version("999")


@pytest.mark.parametrize(
    ("running", "at_least_2_15"),
    [
        ("2.11.0+cu130", False),
        ("2.14.1", False),
        ("2.15.0a0+git1234", False),  # a build before the 2.15 release
        ("2.15.0+cpu", True),
        ("2.16.1", True),
    ],
)
def test_torch_min_version_and_the_feature_it_gates(monkeypatch, running, at_least_2_15):
    monkeypatch.setattr(torch, "__version__", running)
    assert str(get_torch_version()) == running
    assert is_torch_min_version("2.15") is at_least_2_15
    assert is_torch_min_version("2.11", check_equality=False) is not running.startswith("2.11")
    assert dtensor_masked_assign_keeps_shard() is at_least_2_15
