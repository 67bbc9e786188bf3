"""A plain training loop on fsdp-mesh + fsdp-buffers alone matches one process."""

import importlib.util
from pathlib import Path

import pytest
import torch

from fsdp_mesh.testing import run_distributed

_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "standalone_loop.py"


def _example():
    spec = importlib.util.spec_from_file_location("standalone_loop_example", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(strategy):
    return _example().train(strategy, steps=10, per_rank_batch=4)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_ten_adamw_steps_match_single_process(world_size, strategy):
    results = run_distributed(_train, world_size, args=(strategy,))
    ref = _example().reference(steps=10, global_batch=4 * world_size)
    for rank_result in results:
        assert rank_result["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=1e-7)
        assert set(rank_result["params"]) == set(ref["params"])
        for name, expected in ref["params"].items():
            torch.testing.assert_close(rank_result["params"][name], expected, rtol=1e-5, atol=1e-6)
