"""What each rank measures, and what it is compared with.

:class:`CollectiveCounter` counts the elements and bytes of torch.distributed's
collectives, :class:`MemoryProbe` the peak memory over a baseline;
:func:`expected_fsdp_elements` is what fsdp's buckets imply per step and
:func:`theory_elements` DESIGN.md's bound on the per-rank traffic.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

__all__ = [
    "CollectiveCounter",
    "MemoryProbe",
    "TensorTrace",
    "expected_fsdp_elements",
    "theory_elements",
]


# ---- counting collectives -------------------------------------------------------------
class CollectiveCounter:
    """Wraps torch.distributed's collectives in this process and counts the unsharded
    elements and bytes each covers (outermost call only: a wrapper calling another is
    counted once)."""

    _NAMES: ClassVar[
        dict[str, tuple[str, tuple[str, int]]]
    ] = {  # name -> (kind, (keyword, position) of the unsharded tensor(s))
        "all_gather": ("all_gather", ("tensor_list", 0)),
        "reduce_scatter": ("reduce_scatter", ("input_list", 1)),
    }

    # The single-tensor collectives are counted at the process group's own methods,
    # which torch's functions call and a library may call directly (fsdp does, Note
    # [direct collectives]; wrapping torch's functions too would send fsdp through them).
    # Positions count ``self``.
    _GROUP_METHODS: ClassVar[dict[str, tuple[str, tuple[str, int]]]] = {
        "all_gather_single": ("all_gather", ("output", 1)),
        "_allgather_base": ("all_gather", ("output", 1)),
        "reduce_scatter_single": ("reduce_scatter", ("input", 2)),
        "_reduce_scatter_base": ("reduce_scatter", ("input", 2)),
        "allreduce": ("all_reduce", ("tensors", 1)),
    }

    def __init__(self) -> None:
        self._local = threading.local()
        self.reset()
        for name, (kind, where) in self._NAMES.items():
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(original, kind, where))
        for name, (kind, where) in self._GROUP_METHODS.items():
            original = getattr(dist.ProcessGroup, name, None)
            if original is not None:
                setattr(dist.ProcessGroup, name, self._wrap(original, kind, where))

    def reset(self) -> None:
        self.numel = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        self.bytes = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        self.calls = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}

    def _wrap(self, original: Callable, kind: str, where: tuple[str, int]) -> Callable:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                keyword, position = where
                tensors = kwargs[keyword] if keyword in kwargs else args[position]
                if isinstance(tensors, torch.Tensor):
                    tensors = [tensors]
                self.calls[kind] += 1
                for t in tensors:
                    self.numel[kind] += t.numel()
                    self.bytes[kind] += t.numel() * t.element_size()
            self._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth = depth

        return wrapper


# ---- memory -----------------------------------------------------------------------------
def _proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class MemoryProbe:
    """Peak memory over a baseline: RSS on CPU, allocated bytes on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline = self.current()

    def current(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device)
        return _proc_status_kb("VmRSS") * 1024

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        # Writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def peak_increase(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return _proc_status_kb("VmHWM") * 1024 - self.baseline


class TensorTrace:
    """CPU: the peak of live tensor bytes over a baseline, CUDA's ``max_memory_allocated``
    analogue (RSS also counts what glibc keeps of freed blocks, gloo's buffers and
    Python objects, and moves by a few MB with the allocator's thresholds).

    torch's CPU allocator reports each allocation and free to the profiler while it
    records memory, but only on the threads it records: a tensor whose last reference a
    gloo worker thread drops (a collective's buffer, when the caller let go first) is
    freed there, unreported. Summing the reported sizes then counts such a block as live
    until the end, and by a different amount each run, as the race falls (10-90 MB a
    step on the GPT, for fsdp and FSDP2 alike). So the trace turns on the allocator's own
    accounting of every thread (``caffe2_report_cpu_memory_usage``, which keeps the
    running total of live CPU blocks that each reported event carries) and reads that
    total at each of the recording thread's allocations and frees. Blocks allocated
    before the trace are not in that total, so it starts before the model is built.
    ``mark("baseline")`` after the build, ``window()`` around the step to measure;
    :meth:`peak_increase` is the most live bytes inside the window minus those at the
    baseline mark."""

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._was_counting = _count_every_thread(True)
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        self._peak: int | None = None

    def mark(self, name: str) -> None:
        with torch.profiler.record_function(f"bench.{name}"):
            pass

    def window(self) -> Any:
        return torch.profiler.record_function("bench.window")

    def stop(self) -> None:
        self._prof.__exit__(None, None, None)
        _count_every_thread(self._was_counting)
        marks: dict[str, tuple[int, int]] = {}
        memory: list[tuple[int, int]] = []  # (time, live bytes of every thread after it)
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
        while stack:
            node = stack.pop()
            if node.name == "[memory]":
                memory.append((node.start_time_ns, node.extra_fields.total_allocated))
            elif node.name.startswith("bench."):
                marks[node.name] = (node.start_time_ns, node.end_time_ns)
            stack.extend(node.children)
        if "bench.baseline" not in marks or "bench.window" not in marks:
            raise RuntimeError(f"TensorTrace: marks missing, found {sorted(marks)}")
        baseline_at = marks["bench.baseline"][0]
        start, end = marks["bench.window"]
        memory.sort()
        at_baseline = live = 0
        peak: int | None = None  # live bytes at the window's start, then its maximum
        for t, total in memory:
            if t > end:
                break
            if t >= start and peak is None:
                peak = live
            live = total
            if t <= baseline_at:
                at_baseline = live
            if peak is not None:
                peak = max(peak, live)
        self._peak = (live if peak is None else peak) - at_baseline
        self._prof = None  # type: ignore[assignment]

    def peak_increase(self) -> int:
        if self._peak is None:
            raise RuntimeError("TensorTrace.stop() was not called")
        return self._peak


def _count_every_thread(on: bool) -> bool:
    """Turn c10's accounting of CPU blocks on every thread on or off (a process-wide
    flag; with it on, c10 also logs each block at INFO, below its default level);
    returns what it was. Without it the trace would count a block freed on a thread it
    does not record as live to the end."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    try:
        flag = ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage")
    except ValueError as err:
        raise RuntimeError(
            "TensorTrace needs c10's FLAGS_caffe2_report_cpu_memory_usage (to count blocks "
            f"freed on gloo's threads); this torch build does not export it: {err}"
        ) from err
    was = bool(flag.value)
    flag.value = on
    return was


# ---- expected bytes --------------------------------------------------------------------
def expected_fsdp_elements(model: Any) -> dict[str, int]:
    """Unsharded elements per step that fsdp's buckets imply (padding included).

    ZeRO-3: a unit's sharded bucket is gathered in forward and again in backward; a root
    bucket (outside units, or tied across the boundary) once, kept until the end of
    backward; a frozen bucket once (forward only: it assumes no gradient flows through
    frozen units, true for an encoder at the input). Below ZeRO-3, each trainable bucket
    whose main weights are sharded but compute weights replicated is gathered once after
    the optimizer step. Every trainable bucket is reduce-scattered (sharded grads or main
    weights) or all-reduced (replicated). After every backward, one all-reduce of a
    byte per trainable parameter agrees on which ones got a gradient on some rank (the
    others keep ``.grad`` None, as in plain PyTorch), and, in the same collective, a byte
    per trainable bucket on which ones some rank holds gradients for that came after
    their reduction; ``reached_flags`` says how many of the all-reduced elements are
    those (``comm_stats()`` leaves them out)."""
    buffer = model.buffer
    root = set(model.hooks.root_groups)
    out = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for gid, group in enumerate(buffer.groups):
        total = buffer.buckets[gid].layout.total_numel
        weights = group.model_weight_buffer
        sharding = buffer.buckets[gid].sharding
        if weights is not None and weights.is_data_distributed:
            if gid in root or not group.requires_grad:
                out["all_gather"] += total
            else:
                out["all_gather"] += 2 * total
        elif group.requires_grad and sharding.main_weights:
            out["all_gather"] += total
        if group.requires_grad:
            if sharding.grads or sharding.main_weights:
                out["reduce_scatter"] += total
            elif buffer.buckets[gid].shard.size > 1:
                out["all_reduce"] += total
    trainable = [g for g in buffer.groups if g.requires_grad]
    flags = sum(len(g.params) for g in trainable) + len(trainable)
    out["all_reduce"] += flags
    out["reached_flags"] = flags
    return out


def theory_elements(
    strategy: int, trainable: int, frozen_sharded: int, world: int
) -> tuple[float, str]:
    """DESIGN.md's bound on the per-rank ring traffic, in elements per step."""
    ring = (world - 1) / world
    if strategy == 3:
        return (3 * trainable + frozen_sharded) * ring, "3·Ψ·(N−1)/N" + (
            " + Ψ_frozen·(N−1)/N" if frozen_sharded else ""
        )
    return 2 * trainable * ring, "2·Ψ·(N−1)/N"
