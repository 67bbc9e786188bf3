"""One benchmark repetition inside one rank process (started by
``fsdp_mesh.testing.run_distributed``): build, wrap with a peer, time the steps and
measure memory and communication. :func:`bench_rank` must stay a module-level function.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.measure import (
    CollectiveCounter,
    MemoryProbe,
    TensorTrace,
    expected_fsdp_elements,
    theory_elements,
)
from benchmarks.workloads import build_model, loss_of, make_batch, unit_classes

__all__ = ["IMPLS", "bench_rank"]

IMPLS = ("fsdp", "fsdp2", "megatron_fsdp")
# fsdp with options, as a peer of its own: "fsdp@cu=4096:pd=2" is fully_shard with
# suggested_communication_unit_size=4096 (elements) and prefetch_depth=2; "opg=0" is
# overlap_param_gather=False.
_FSDP_OPTIONS = {
    "cu": "suggested_communication_unit_size",
    "pd": "prefetch_depth",
    "opg": "overlap_param_gather",
}
_BOOL_OPTIONS = {"overlap_param_gather"}


def fsdp_options(impl: str) -> dict[str, int | bool] | None:
    """The fully_shard options of an ``fsdp`` peer name, None for another peer."""
    name, _, spec = impl.partition("@")
    if name != "fsdp":
        return None
    out = {}
    for item in filter(None, spec.split(":")):
        key, _, value = item.partition("=")
        if key not in _FSDP_OPTIONS or not value.isdigit():
            raise ValueError(f"bad fsdp peer option {item!r} in {impl!r}; use cu=N:pd=N:opg=0|1")
        name = _FSDP_OPTIONS[key]
        out[name] = bool(int(value)) if name in _BOOL_OPTIONS else int(value)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_rank(
    impl: str,
    workload: str,
    size: dict[str, Any],
    strategy: int,
    no_shard_encoder: bool,
    steps: int,
    warmup: int,
    profile_dir: str | None = None,
    trace_tensors: bool = False,
    before_timed: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """One repetition on this rank: build, wrap, ``warmup`` steps, ``steps`` timed steps.

    ``trace_tensors`` (CPU): instead, trace live tensor bytes from before the build
    through one untimed step after the warm-up, and return their peak over the built
    model (``tensor_peak_bytes``) only: the trace slows the steps and its buffers would
    count in RSS, so it is a repetition of its own.

    ``before_timed`` is called once the warm-up is done, right before the timed steps
    (``benchmarks.hook_cpu`` restarts its counts there)."""
    # Import every peer before the memory baseline, so that no peer's RSS counts
    # another's (or its own) module imports.
    import torch.distributed.fsdp

    import fsdp  # noqa: F401

    counter = CollectiveCounter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    trace = TensorTrace() if trace_tensors else None
    module = build_model(workload, size).to(device)
    n_trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    n_frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    probe = MemoryProbe(device)
    if trace is not None:
        trace.mark("baseline")
    units = unit_classes(workload)
    frozen_sharded = 0 if no_shard_encoder else n_frozen
    result: dict[str, Any] = {"rank": rank, "world": world, "device": str(device)}

    model: Any
    options = fsdp_options(impl)
    if impl == "floor":
        model = module
        optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
        frozen_sharded = 0
    elif options is not None:
        from fsdp import fsdp_no_shard, fully_shard

        if no_shard_encoder:
            fsdp_no_shard(module.encoder)
        optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
        model, optimizer = fully_shard(
            module, optimizer, fsdp_unit_modules=units, zero_dp_strategy=strategy, **options
        )
    elif impl == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

        mesh = init_device_mesh(device.type, (world,))
        reshard = strategy == 3
        ignored = set(module.encoder.parameters()) if no_shard_encoder else None
        for sub in module.modules():
            if isinstance(sub, tuple(units)) and not (no_shard_encoder and sub is module.encoder):
                fsdp2_fully_shard(sub, mesh=mesh, reshard_after_forward=reshard)
        fsdp2_fully_shard(module, mesh=mesh, reshard_after_forward=reshard, ignored_params=ignored)
        model = module
        optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
    elif impl == "megatron_fsdp":
        import megatron_fsdp

        if no_shard_encoder:
            raise ValueError("megatron_fsdp has no fsdp_no_shard; not run for that variant")
        optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
        model, optimizer = megatron_fsdp.fully_shard(
            module, optimizer, fsdp_unit_modules=units, zero_dp_strategy=strategy
        )
    else:
        raise ValueError(f"unknown impl {impl!r}; choose from {(*IMPLS, 'floor')}")

    cpu_times: list[float] = []

    def one_step(step: int) -> float:
        inputs, target = make_batch(workload, size, step, rank, world, device)
        _sync(device)
        start, cpu = time.perf_counter(), time.thread_time()
        loss = loss_of(workload, model(*inputs), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        _sync(device)
        cpu_times.append(time.thread_time() - cpu)
        return time.perf_counter() - start

    result["wrapped_bytes"] = probe.current() - probe.baseline
    probe.reset_peak()
    for step in range(warmup):
        one_step(step)
    if trace is not None:
        with trace.window():
            one_step(warmup)
        trace.stop()
        return {"rank": rank, "tensor_peak_bytes": trace.peak_increase()}
    counter.reset()
    if options is not None:
        model.comm_stats(reset=True)
    # Collect what building and wrapping left (every peer alike): else the one full
    # collection it triggers (0.2-1 s on 2 loaded cores) lands in some peer's timed
    # steps and not another's, inside whatever function allocated at that moment.
    gc.collect()
    profiler = _profiler(profile_dir, impl, workload, strategy, no_shard_encoder, rank)
    cpu_times.clear()  # the timed steps only
    if before_timed is not None:
        before_timed()
    with profiler:
        times = [one_step(warmup + step) for step in range(steps)]
    result["step_s"] = times
    # CPU time of this rank's main thread per step (OMP_NUM_THREADS=1: torch's kernels
    # run on it; gloo's transfers and the time it waits or is descheduled do not count).
    result["cpu_s"] = list(cpu_times)
    result["peak_bytes"] = probe.peak_increase()
    result["end_bytes"] = probe.current() - probe.baseline
    result["elements"] = {k: v / steps for k, v in counter.numel.items()}
    result["bytes"] = {k: v / steps for k, v in counter.bytes.items()}
    result["calls"] = {k: v / steps for k, v in counter.calls.items()}
    result["trainable_params"] = n_trainable
    result["frozen_params"] = n_frozen
    theory, formula = theory_elements(strategy, n_trainable, frozen_sharded, world)
    result["theory_elements"] = 0.0 if impl == "floor" else theory
    result["theory_formula"] = formula
    if options is not None:
        result["trainable_buckets"] = sum(g.requires_grad for g in model.buffer.groups)
        stats = model.comm_stats()
        result["comm_stats"] = {
            k: {f: v / steps for f, v in fields.items()} for k, fields in stats.items()
        }
        result["expected_elements"] = expected_fsdp_elements(model)
    return result


def _profiler(
    profile_dir: str | None, impl: str, workload: str, strategy: int, no_shard: bool, rank: int
) -> Any:
    if profile_dir is None:
        return contextlib.nullcontext()
    import cProfile
    import pstats

    path = Path(profile_dir) / (
        f"{workload}{'-noshard' if no_shard else ''}-zero{strategy}-{impl}-rank{rank}"
    )

    @contextlib.contextmanager
    def run() -> Any:
        prof = cProfile.Profile()
        prof.enable()
        try:
            yield
        finally:
            prof.disable()
            prof.dump_stats(str(path) + ".prof")
            with open(str(path) + ".txt", "w") as f:
                pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
                pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(60)

    return run()
