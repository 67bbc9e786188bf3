"""The test device: ``--fsdp-device cuda`` (or ``FSDP_TEST_DEVICE=cuda``) runs the tests
marked ``cuda`` on CUDA + NCCL, one GPU per rank (``fsdp_mesh.testing``), and skips the
others, which are written for CPU; the default, CPU, changes nothing."""

from __future__ import annotations

import os

import pytest

from fsdp_mesh.testing import TEST_DEVICE_ENV, harness_device_type


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fsdp-device",
        choices=("cpu", "cuda"),
        default=None,
        help=f"device the distributed tests run on (default: ${TEST_DEVICE_ENV}, else cpu); "
        "cuda runs only the tests marked 'cuda'",
    )


def pytest_configure(config: pytest.Config) -> None:
    chosen = config.getoption("--fsdp-device")
    if chosen is not None:
        # The environment, so that the rank processes see it too.
        os.environ[TEST_DEVICE_ENV] = chosen
    harness_device_type()  # a bad value fails here, once, with what is allowed


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if harness_device_type() != "cuda":
        return
    skip = pytest.mark.skip(reason=f"{TEST_DEVICE_ENV}=cuda runs only the tests marked 'cuda'")
    for item in items:
        if item.get_closest_marker("cuda") is None:
            item.add_marker(skip)
