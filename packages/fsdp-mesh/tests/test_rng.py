"""The RNG tracker: forks draw from their own stream and leave the default one alone."""

import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from fsdp_mesh import (
    MODEL_PARALLEL_RNG_TRACKER_NAME,
    RNGStatesTracker,
    get_cuda_rng_tracker,
    get_rng_tracker,
    initialize_rng_tracker,
    model_parallel_seed,
)
from fsdp_mesh.testing import run_distributed


@pytest.fixture(autouse=True)
def fresh_tracker():
    state = torch.get_rng_state()
    initialize_rng_tracker(force_reset=True, device_type="cpu")
    yield
    initialize_rng_tracker(force_reset=True)
    torch.set_rng_state(state)


def test_fork_leaves_default_stream_untouched():
    torch.manual_seed(7)
    expected = torch.rand(8)
    torch.manual_seed(7)
    tracker = get_rng_tracker()
    tracker.add("tp", 123)
    with tracker.fork("tp"):
        inside = torch.rand(8)
    assert torch.equal(torch.rand(8), expected)
    assert not torch.equal(inside, expected)


def test_fork_continues_its_own_stream():
    tracker = get_rng_tracker()
    tracker.add("tp", 99)
    with tracker.fork("tp"):
        first = torch.rand(4)
    torch.rand(100)  # default-stream draws in between do not matter
    with tracker.fork("tp"):
        second = torch.rand(4)
    reference = torch.Generator().manual_seed(99)
    assert torch.equal(torch.cat([first, second]), torch.rand(8, generator=reference))


def test_states_round_trip():
    tracker = get_rng_tracker()
    tracker.add("a", 1)
    saved = {name: state.clone() for name, state in tracker.get_states().items()}
    with tracker.fork("a"):
        first = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), first)
    assert tracker.get_states() is not tracker.states_


def test_add_and_fork_errors():
    tracker = get_rng_tracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1 is already used"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match=r"state named 'a' already exists.*\['a'\]"):
        tracker.add("a", 2)
    with (
        pytest.raises(KeyError, match=r"no state named 'missing'.*\['a'\]"),
        tracker.fork("missing"),
    ):
        pass
    tracker.reset()
    assert not tracker.is_initialized() and tracker.get_states() == {}
    with pytest.raises(ValueError, match="device types 'cpu' and 'cuda'; got 'meta'"):
        RNGStatesTracker("meta")


def test_state_is_restored_when_the_block_raises():
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    tracker = get_rng_tracker()
    tracker.add("a", 5)
    with pytest.raises(RuntimeError, match="boom"), tracker.fork("a"):
        torch.rand(2)
        raise RuntimeError("boom")
    assert torch.equal(torch.rand(2), expected)


def test_singleton_and_megatron_keywords():
    tracker = get_cuda_rng_tracker()
    assert get_rng_tracker() is tracker
    initialize_rng_tracker()  # no reset: the same tracker stays
    assert get_cuda_rng_tracker() is tracker
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        initialize_rng_tracker(use_te_rng_tracker=True, force_reset=True, device_type="cpu")
        initialize_rng_tracker(use_te_rng_tracker=True, force_reset=True, device_type="cpu")
    assert get_rng_tracker() is not tracker
    messages = [str(w.message) for w in caught]
    assert len(messages) <= 1  # warned once per process (maybe by an earlier test)
    assert all("Transformer Engine's RNG tracker is not supported" in m for m in messages)


def test_inference_tracker_is_a_no_op():
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True, device_type="cpu")
    tracker = get_rng_tracker()
    tracker.add("a", 1)
    assert tracker.get_states() == {}
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    with tracker.fork("anything"):
        assert torch.equal(torch.rand(2), expected)


def test_cudagraphable_rng_is_ignored_on_cpu():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tracker = RNGStatesTracker("cpu", use_cudagraphable_rng=True)
    assert tracker.use_cudagraphable_rng is False


def test_model_parallel_seed_values():
    tracker = model_parallel_seed(1000, tp_rank=3, ep_rank=2, expt_tp_rank=1)
    assert tracker is get_rng_tracker()
    assert tracker.seeds_ == {1000 + 2718 + 3, 1000 + 1024 + 200 + 1}
    with tracker.fork(MODEL_PARALLEL_RNG_TRACKER_NAME):
        got = torch.rand(4)
    assert torch.equal(got, torch.rand(4, generator=torch.Generator().manual_seed(3721)))
    assert torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(1000)))
    with pytest.raises(ValueError, match="non-negative; got tp_rank=-1"):
        model_parallel_seed(1, tp_rank=-1)


def _dropout_masks(seed: int):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_rank = mesh.get_local_rank("tp")
    initialize_rng_tracker(force_reset=True, device_type="cpu")
    tracker = model_parallel_seed(seed, tp_rank)
    x = torch.ones(64)
    with tracker.fork():
        tp_mask = torch.nn.functional.dropout(x, p=0.5) != 0
    outside = torch.nn.functional.dropout(x, p=0.5) != 0
    return {"dp": mesh.get_local_rank("dp"), "tp": tp_rank, "fork": tp_mask, "outside": outside}


def test_dropout_masks_differ_across_tp_and_match_across_dp():
    out = run_distributed(_dropout_masks, 4, args=(1234,), device_type="cpu")
    assert [(o["dp"], o["tp"]) for o in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for a in out:
        for b in out:
            assert torch.equal(a["fork"], b["fork"]) == (a["tp"] == b["tp"])
            assert torch.equal(a["outside"], b["outside"])
