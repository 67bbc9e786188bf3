"""The harness itself: results, failures, hangs and early exits, and no leftovers."""

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fsdp_mesh.testing import (
    TEST_DEVICE_ENV,
    DistributedTestError,
    DistributedTestTimeout,
    _runner,
    harness_device_type,
    run_distributed,
    world_sizes,
)


def _is_running(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        state = next(line for line in status.read_text().splitlines() if line.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return False
    return "Z" not in state.split()[1]


def _sum_ranks(offset: float):
    t = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(t)
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "sum": t.item(),
        "threads": torch.get_num_threads(),
        "omp": os.environ["OMP_NUM_THREADS"],
        "backend": dist.get_backend(),
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_by_rank(world_size):
    out = run_distributed(_sum_ranks, world_size, args=(1.0,))
    expected_sum = sum(range(world_size)) + world_size
    assert [o["rank"] for o in out] == list(range(world_size))
    assert all(o["world"] == world_size and o["sum"] == expected_sum for o in out)
    assert all(o["threads"] == 1 and o["omp"] == "1" for o in out)
    assert {o["backend"] for o in out} == {"gloo"}


def _port():
    return int(os.environ["MASTER_PORT"])


def test_each_run_gets_its_own_port():
    first = run_distributed(_port, 2)
    second = run_distributed(_port, 2)
    assert first[0] == first[1] and second[0] == second[1]
    assert first[0] != second[0]


def _rank1_raises():
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()  # rank 0 blocks here until the harness stops it


def test_raising_rank_shows_its_traceback_and_nothing_survives():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank1_raises, 2, timeout=60)
    elapsed = time.monotonic() - start
    msg = str(info.value)
    assert msg.startswith("rank 1 of 2 failed first (raised)")
    assert "ValueError: rank one is unhappy" in msg
    assert "_rank1_raises" in msg  # the frame is in the traceback
    assert 1 in info.value.failed_ranks
    # The failure ends the run long before the 60 s deadline.
    assert elapsed < 30
    assert not any(_is_running(pid) for pid in info.value.pids)


def _rank1_hangs():
    if dist.get_rank() == 1:
        while True:
            time.sleep(0.05)
    return "done"


def test_hanging_rank_is_named_and_killed_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(DistributedTestTimeout) as info:
        run_distributed(_rank1_hangs, 2, timeout=3)
    elapsed = time.monotonic() - start
    assert info.value.hung_ranks == [1]
    msg = str(info.value)
    assert "ranks [1] of 2 did not finish within 3.0 s" in msg
    # faulthandler's dump of the hung rank shows where it was stuck.
    assert "_rank1_hangs" in msg
    assert 3 <= elapsed < 15
    assert not any(_is_running(pid) for pid in info.value.pids)


def _ranks_wait_in_mismatched_collectives():
    # Rank 0 waits in a barrier that rank 1 never joins; rank 1 waits for a message
    # that never comes. Neither exits, so gloo cannot notice anything is wrong.
    if dist.get_rank() == 0:
        dist.barrier()
    else:
        dist.recv(torch.zeros(1), src=0)


def test_hung_collective_fails_within_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedTestTimeout) as info:
        run_distributed(_ranks_wait_in_mismatched_collectives, 2, timeout=3)
    assert time.monotonic() - start < 15
    assert info.value.hung_ranks == [0, 1]
    assert not any(_is_running(pid) for pid in info.value.pids)


def _rank2_exits_early():
    if dist.get_rank() == 2:
        os._exit(3)
    dist.barrier()


def test_rank_exiting_early_is_reported_with_its_code():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank2_exits_early, 4, timeout=60)
    msg = str(info.value)
    assert msg.startswith("rank 2 of 4 failed first (exited with code 3 before returning a result)")
    assert 2 in info.value.failed_ranks
    assert not any(_is_running(pid) for pid in info.value.pids)


def _print_then_fail():
    print("diagnostic line from the rank", flush=True)
    raise RuntimeError("boom")


def test_rank_output_is_shown_with_the_failure():
    with pytest.raises(DistributedTestError, match="diagnostic line from the rank"):
        run_distributed(_print_then_fail, 1)


def test_nested_functions_are_rejected_with_a_reason():
    def local():
        return 1

    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(local, 2)
    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(lambda: 1, 2)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        run_distributed(_port, 0)
    with pytest.raises(ValueError, match="timeout must be positive"):
        run_distributed(_port, 1, timeout=0)
    with pytest.raises(ValueError, match="device_type must be"):
        run_distributed(_port, 1, device_type="tpu")


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="only meaningful without 2 GPUs")
def test_asking_for_missing_gpus_is_an_error():
    with pytest.raises(RuntimeError, match="needs 2 CUDA devices"):
        run_distributed(_port, 2, device_type="cuda")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_is_used_with_enough_gpus():
    out = run_distributed(_sum_ranks, 2, args=(0.0,), device_type="cuda")
    assert {o["backend"] for o in out} == {"nccl"}


def test_spawn_start_method_also_works():
    out = run_distributed(_sum_ranks, 2, args=(0.0,), start_method="spawn")
    assert [o["sum"] for o in out] == [1.0, 1.0]


def _fork_a_sleeper() -> int:
    """Fork a process that would outlive the rank (as Megatron-Core's checkpoint writer
    forks workers) and return its pid."""
    pid = os.fork()
    if pid == 0:  # the forked process: sleeps far past the test, then leaves quietly
        time.sleep(120)
        os._exit(0)
    return pid


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_what_a_rank_forks_does_not_outlive_the_run(start_method):
    pids = run_distributed(_fork_a_sleeper, 2, timeout=60, start_method=start_method)
    # SIGKILL is delivered asynchronously: give the kernel a moment, bounded.
    deadline = time.monotonic() + 10
    while any(_is_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_is_running(pid) for pid in pids), pids


def test_the_test_device_is_cpu_unless_cuda_is_asked_for(monkeypatch):
    monkeypatch.delenv(TEST_DEVICE_ENV, raising=False)
    assert harness_device_type() == "cpu"
    assert world_sizes(2, 4) == [2, 4]
    monkeypatch.setenv(TEST_DEVICE_ENV, "tpu")
    with pytest.raises(ValueError, match=r"FSDP_TEST_DEVICE must be one of \['cpu', 'cuda'\]"):
        harness_device_type()


def test_on_cuda_worlds_follow_the_gpu_count(monkeypatch):
    monkeypatch.setenv(TEST_DEVICE_ENV, "cuda")
    for gpus, want in ((0, [1]), (1, [1]), (3, [2]), (8, [2, 4])):
        monkeypatch.setattr(_runner, "_gpu_count", lambda g=gpus: g)
        assert world_sizes(2, 4) == want, gpus
    assert world_sizes(1, 2, 4) == [1, 2, 4]


def test_on_cuda_a_world_larger_than_the_gpus_skips(monkeypatch):
    monkeypatch.setenv(TEST_DEVICE_ENV, "cuda")
    monkeypatch.setattr(_runner, "_gpu_count", lambda: 1)
    with pytest.raises(pytest.skip.Exception, match="needs 2 GPUs \\(one per rank\\), found 1"):
        run_distributed(_port, 2)
    # An explicit device is still an error, not a skip.
    with pytest.raises(RuntimeError, match="needs 2 CUDA devices"):
        run_distributed(_port, 2, device_type="cuda")
