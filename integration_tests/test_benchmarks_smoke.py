"""The benchmark runner (benchmarks/compare.py) on tiny models: every workload under
ZeRO-3 and ZeRO-2, both peers (fsdp, FSDP2) and the floor run; fsdp communicates exactly
what its buckets imply, never more than 1% above theory, and the recorded overhead
workload moves exactly theory. Times are not asserted."""

import pytest

from benchmarks.compare import run_benchmark

# Units of Linear(128, 128): every parameter is split into torch.chunk pieces (Note
# [shard layout]); 128 rows and 128 bias elements chunk evenly over 2 ranks, so no padding.
SIZES = {
    "overhead": {"n_units": 4, "dim": 128, "batch": 2},
    # dim 64: every shard of a unit (16608 elements) is a multiple of the 16-element
    # alignment, so the only excess is the one byte per parameter of reached flags.
    "blocks": {"n_units": 2, "dim": 64, "batch": 2},
    "frozen": {
        "patch_dim": 12,
        "patches": 4,
        "enc_dim": 32,
        "enc_layers": 2,
        "vocab": 64,
        "dim": 32,
        "heads": 4,
        "layers": 2,
        "seq": 8,
        "batch": 2,
    },
}


WORKLOADS = ("overhead", "blocks", "compute", "frozen")
STRATEGIES = (3, 2)


def _run(workloads, impls, sizes, floor):
    return run_benchmark(
        workloads,
        STRATEGIES,
        reps=1,
        tiny=True,
        world_size=2,
        device_type="cpu",
        impls=impls,
        timeout=60.0,
        log=lambda _line: None,
        sizes=sizes,
        floor=floor,
    )


@pytest.fixture(scope="module")
def result():
    """Every workload and strategy, both peers and the floor: what the runner does."""
    return _run(WORKLOADS, ("fsdp", "fsdp2"), SIZES, floor=True)


def _row(result, config, impl):
    (row,) = [r for r in result["rows"] if r["config"] == config and r["impl"] == impl]
    return row


def _configs():
    for strategy in STRATEGIES:
        for config in ("overhead", "blocks", "compute", "frozen", "frozen+no_shard"):
            yield f"{config} ZeRO-{strategy}"


def test_every_peer_ran(result):
    ran = {(r["config"], r["impl"]) for r in result["rows"]}
    assert ran == {(c, impl) for c in _configs() for impl in ("fsdp", "fsdp2")}
    for row in result["rows"]:
        assert row["step_ms"] > 0
        assert isinstance(row["peak_mb"], float)
    for config in _configs():
        row = _row(result, config, "fsdp")
        assert row["floor_ms"] > 0 and row["time_vs_floor"] > 0, config
        assert row["time_vs_fsdp2"] > 0 and row["mem_vs_fsdp2"] is not None, config


@pytest.mark.parametrize("config", list(_configs()))
def test_fsdp_bytes_are_exactly_what_its_buckets_imply(result, config):
    row = _row(result, config, "fsdp")
    expected = row["expected_elements"]
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert row["elements"][kind] == expected[kind], kind
    # The library's own accounting agrees with the collectives actually called (it
    # leaves out the one-byte-per-parameter agreement on which parameters got a gradient).
    stats = row["comm_stats"]
    flags = {"all_reduce": expected["reached_flags"]}
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert stats[kind]["numel"] == row["elements"][kind] - flags.get(kind, 0), kind
    # Never more than 1% above theory; below it where root buckets are gathered once.
    assert row["traffic_vs_theory"] <= 1.01, row["traffic_vs_theory"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_traffic_within_one_percent_of_theory_without_padding(result, strategy):
    for impl in ("fsdp", "fsdp2"):
        row = _row(result, f"overhead ZeRO-{strategy}", impl)
        assert row["traffic_vs_theory"] == pytest.approx(1.0, rel=0.01), impl


def test_real_overhead_shape_moves_exactly_theory():
    # The recorded workload's Linear(64, 64) units: weight and bias chunk evenly over 2
    # ranks (torch.chunk pieces, no padding), so fsdp moves exactly theory, as FSDP2.
    sizes = {"overhead": {"n_units": 4, "dim": 64, "batch": 2}}
    real = _run(("overhead",), ("fsdp",), sizes, floor=False)
    for strategy in STRATEGIES:
        row = _row(real, f"overhead ZeRO-{strategy}", "fsdp")
        moved = row["elements"]["all_gather"] + row["elements"]["reduce_scatter"]
        assert moved == (3 if strategy == 3 else 2) * row["trainable_params"], strategy
        # Besides: one byte per parameter (4 units x weight and bias) agreeing on which
        # parameters got a gradient on some rank, and one per trainable bucket on which
        # hold gradients that came after their reduction, in the same collective.
        assert row["elements"]["all_reduce"] == 4 * 2 + row["trainable_buckets"], strategy


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_shard_encoder_is_never_gathered(result, strategy):
    sharded = _row(result, f"frozen ZeRO-{strategy}", "fsdp")
    replicated = _row(result, f"frozen+no_shard ZeRO-{strategy}", "fsdp")
    frozen = sharded["frozen_params"]
    assert frozen > 0
    gathered_encoder = sharded["elements"]["all_gather"] - replicated["elements"]["all_gather"]
    if strategy == 3:
        assert gathered_encoder >= frozen  # the sharded encoder is gathered (padded) once
    else:  # compute weights are replicated below ZeRO-3: nothing to gather either way
        assert gathered_encoder == 0
    assert replicated["elements"]["reduce_scatter"] == sharded["elements"]["reduce_scatter"]


@pytest.mark.parametrize("workload", ["blocks", "compute"])
def test_comm_floor_schedule_moves_the_theory_of_its_strategy(workload):
    """benchmarks.comm_floor's collectives are one step's: every trainable parameter in
    exactly one bucket; per step 3·Ψ elements of the units and 2·Ψ of the root (gathered
    once and held) under ZeRO-3, 2·Ψ under ZeRO-2."""
    from benchmarks.comm_floor import _schedule, bucket_sizes
    from benchmarks.workloads import WORKLOADS, build_model

    model = build_model(workload, WORKLOADS[workload].full)
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    root, units = bucket_sizes(workload)
    assert root + sum(units) == psi
    assert len(units) == WORKLOADS[workload].full.get(
        "n_units", WORKLOADS[workload].full.get("layers")
    )
    for strategy, factor in ((3, 3), (2, 2)):
        schedule = _schedule(strategy, root, units)
        assert sum(n for _op, n in schedule) == factor * sum(units) + 2 * root
        assert sum(n for op, n in schedule if op == "reduce") == psi


def test_host_cpu_per_unit_is_reported_for_every_unit_workload(result):
    from benchmarks.host_time import host_cpu_table

    rows = [line.split("|")[1:-1] for line in host_cpu_table(result)[2:]]
    got = {(cells[0].strip(), cells[1].strip()) for cells in rows}
    want = {
        (f"{w} ZeRO-{s}", impl)
        for w in ("overhead", "blocks")
        for s in STRATEGIES
        for impl in ("fsdp", "fsdp2")
    }
    assert got == want
    for cells in rows:
        cpu = [float(v) for v in cells[2].split("/")]
        assert len(cpu) == 2 and all(v > 0 for v in cpu), cells
        if cells[1].strip() == "fsdp2":
            assert [float(v) for v in cells[5].split("/")] == [1.0, 1.0], cells


def test_hook_cpu_counts_every_hook_call_of_the_timed_steps():
    """benchmarks.hook_cpu times the timed steps only: per step, one pre- and post-forward
    and pre-backward per unit, one gradient hook per parameter and one end of backward,
    each with CPU time; a floor run (unwrapped) times nothing."""
    from benchmarks.hook_cpu import hook_cpu_rank, table
    from fsdp_mesh.testing import run_distributed

    size = SIZES["blocks"]
    steps, n_units, params_per_unit = 3, size["n_units"], 6  # norm, fc1, fc2: weight and bias
    kwargs = {"workload": "blocks", "size": size, "strategy": 3, "steps": steps, "warmup": 1}
    wrapped = run_distributed(
        hook_cpu_rank, 2, kwargs={**kwargs, "wrap": True}, timeout=60, device_type="cpu"
    )
    (floor,) = run_distributed(
        hook_cpu_rank, 1, kwargs={**kwargs, "wrap": False}, timeout=60, device_type="cpu"
    )
    assert floor["methods"] == {} and len(floor["cpu_s"]) == steps
    want = {
        "FSDPHooks._unit_pre_forward": n_units,
        "FSDPHooks._unit_post_forward": n_units,
        "FSDPHooks._group_pre_backward": n_units,  # each member's output carries one
        "FSDPHooks._on_param_grad": n_units * params_per_unit,
        "FSDPHooks._end_of_backward": 1,
        "FSDPHooks.root_pre_forward": 1,
    }
    for rank in wrapped:
        methods = rank["methods"]
        for name, per_step in want.items():
            calls, cpu = methods[name]
            assert calls == per_step * steps, (name, calls)
            assert cpu > 0, name
    assert "FSDPHooks._on_param_grad" in table(size, steps, wrapped, floor)


def test_hook_cpu_refuses_a_method_that_does_not_exist():
    from benchmarks.hook_cpu import timed_methods

    with (
        pytest.raises(AttributeError, match="does not exist"),
        timed_methods(["fsdp_hooks.runtime.hooks:FSDPHooks._no_such_hook"]),
    ):
        pass


def test_host_cpu_summary_gives_each_set_its_worst_rank_and_the_median(result):
    from benchmarks.host_time import host_cpu_rows, host_cpu_summary

    rows = host_cpu_rows(result)
    summary = [line.split("|")[1:-1] for line in host_cpu_summary([result, result])[2:]]
    assert {(c[0].strip(), c[1].strip()) for c in summary} == set(rows)
    for cells in summary:
        worst = max(rows[(cells[0].strip(), cells[1].strip())].ratio)
        per_set = [float(v) for v in cells[2].split("/")]
        assert per_set == [round(worst, 2)] * 2, cells
        assert float(cells[3]) == float(cells[4]) == round(worst, 2), cells
