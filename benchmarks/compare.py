"""fsdp against PyTorch FSDP2 (and Megatron-FSDP on CUDA), side by side in one run.

    uv run python -m benchmarks.compare            # CPU: gloo, 2 ranks, 1 thread each
    uv run python -m benchmarks.compare --help

For every workload, strategy and variant it runs, in alternating repetitions, the same
model (same seed, same per-rank batch, same world size) under:

- ``fsdp``: this library's ``fully_shard`` with the workload's FSDP units;
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on each unit module, then the root
  (``reshard_after_forward=True`` for ZeRO-3, ``False``, its ZeRO-2 analogue, for ZeRO-2;
  parameters that ``fsdp_no_shard`` keeps replicated are FSDP2's ``ignored_params``);
- ``megatron_fsdp``: NVIDIA's ``megatron_fsdp.fully_shard`` (CUDA only, when the ``bench``
  dependency group is installed: ``uv sync --group bench``);
- ``floor``: the model in one process, no wrapper, on the per-rank batch: the compute
  floor a data-parallel rank cannot beat.

Every run is a fresh set of rank processes (``fsdp_mesh.testing.run_distributed``). Each
rank reports, over the timed steps (after the warm-up steps):

- step time (forward, backward, optimizer step, zero_grad), as the slowest rank's;
- peak memory: on CPU the peak RSS (``VmHWM``, reset after wrapping) minus the RSS taken
  right after the unwrapped model was built; on CUDA ``max_memory_allocated`` minus the
  allocated bytes at the same point;
- elements all-gathered, reduce-scattered and all-reduced per step (unsharded sizes),
  counted by wrapping ``torch.distributed``'s collectives inside the rank (the same
  counter for every peer), and for ``fsdp`` also its own ``model.comm_stats()``.

Communication is compared with DESIGN.md's bound ``3·Ψ·(N−1)/N`` elements per step and
rank for ZeRO-3 (Ψ trainable parameters; frozen parameters that are sharded add
``Ψ_frozen·(N−1)/N``, one gather in forward) and ``2·Ψ·(N−1)/N`` for ZeRO-2 (one gather
of the updated weights, one reduce-scatter). ``fsdp``'s count is also checked exactly
against what its buckets imply (:func:`expected_fsdp_elements`).

Results: ``benchmarks/results/compare.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from fsdp_mesh.testing import run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

__all__ = [
    "IMPLS",
    "WORKLOADS",
    "Config",
    "bench_rank",
    "expected_fsdp_elements",
    "main",
    "run_benchmark",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
IMPLS = ("fsdp", "fsdp2", "megatron_fsdp")
SEED = 1234


# ---- models -------------------------------------------------------------------------
class MLPUnit(nn.Module):
    """One small FSDP unit of the overhead-bound workload."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.fc(x))


class DeepMLP(nn.Module):
    """Many small units and nothing outside them: per-unit overhead dominates."""

    def __init__(self, n_units: int, dim: int) -> None:
        super().__init__()
        self.units = nn.ModuleList(MLPUnit(dim) for _ in range(n_units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.units:
            x = unit(x)
        return x


class EncoderLayer(nn.Module):
    """Pre-norm bidirectional transformer layer of the vision encoder."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class VisionEncoder(nn.Module):
    """A ViT-like tower over flattened patches; one FSDP unit, frozen."""

    def __init__(self, patch_dim: int, dim: int, n_layers: int, n_heads: int) -> None:
        super().__init__()
        self.patch = nn.Linear(patch_dim, dim)
        self.layers = nn.ModuleList(EncoderLayer(dim, n_heads) for _ in range(n_layers))
        self.ln = nn.LayerNorm(dim)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.patch(patches)
        for layer in self.layers:
            x = layer(x)
        return self.ln(x)


class VisionLanguageModel(nn.Module):
    """Frozen vision encoder, trainable projector and GPT-style decoder (``Block`` units)."""

    def __init__(self, patch_dim: int, enc_dim: int, enc_layers: int, dec: GPTConfig) -> None:
        super().__init__()
        self.encoder = VisionEncoder(patch_dim, enc_dim, enc_layers, max(1, enc_dim // 64))
        self.encoder.requires_grad_(False)
        self.projector = nn.Linear(enc_dim, dec.dim)
        self.tok = nn.Embedding(dec.vocab_size, dec.dim)
        self.pos = nn.Embedding(dec.max_seq_len, dec.dim)
        self.blocks = nn.ModuleList(Block(dec) for _ in range(dec.n_layers))
        self.ln_f = nn.LayerNorm(dec.dim)
        self.head = nn.Linear(dec.dim, dec.vocab_size, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, patches: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        image = self.projector(self.encoder(patches))
        text = self.tok(idx)
        x = torch.cat([image, text], dim=1)
        x = x + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x[:, image.shape[1] :]))


# ---- workloads ----------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    full: dict[str, Any]  # sizes of the real benchmark
    tiny: dict[str, Any]  # sizes for the smoke test
    steps: int  # timed steps per repetition
    warmup: int


WORKLOADS: dict[str, Workload] = {
    "overhead": Workload(
        "overhead",
        "64 units of Linear(64,64)+ReLU, batch 8 per rank: per-unit overhead dominates",
        full={"n_units": 64, "dim": 64, "batch": 8},
        tiny={"n_units": 8, "dim": 16, "batch": 2},
        steps=20,
        warmup=3,
    ),
    "compute": Workload(
        "compute",
        "GPT, 49M parameters (13 blocks, dim 512, vocab 16384), batch 2x64 tokens per rank",
        full={"vocab": 16384, "dim": 512, "heads": 8, "layers": 13, "seq": 64, "batch": 2},
        tiny={"vocab": 64, "dim": 32, "heads": 4, "layers": 2, "seq": 8, "batch": 2},
        steps=3,
        warmup=1,
    ),
    "frozen": Workload(
        "frozen",
        "vision-language: frozen 14M-parameter encoder (one unit), trainable 4M decoder "
        "(4 blocks), 64 patches + 32 tokens, batch 2 per rank",
        full={
            "patch_dim": 192,
            "patches": 64,
            "enc_dim": 384,
            "enc_layers": 8,
            "vocab": 4096,
            "dim": 256,
            "heads": 4,
            "layers": 4,
            "seq": 32,
            "batch": 2,
        },
        tiny={
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
        steps=5,
        warmup=2,
    ),
}


def build_model(workload: str, size: dict[str, Any]) -> nn.Module:
    torch.manual_seed(SEED)
    if workload == "overhead":
        return DeepMLP(size["n_units"], size["dim"])
    if workload == "compute":
        cfg = GPTConfig(
            vocab_size=size["vocab"],
            max_seq_len=size["seq"],
            dim=size["dim"],
            n_heads=size["heads"],
            n_layers=size["layers"],
        )
        return GPT(cfg)
    if workload == "frozen":
        dec = GPTConfig(
            vocab_size=size["vocab"],
            max_seq_len=size["patches"] + size["seq"],
            dim=size["dim"],
            n_heads=size["heads"],
            n_layers=size["layers"],
        )
        return VisionLanguageModel(size["patch_dim"], size["enc_dim"], size["enc_layers"], dec)
    raise ValueError(f"unknown workload {workload!r}; choose from {sorted(WORKLOADS)}")


def unit_classes(workload: str) -> list[type[nn.Module]]:
    return {
        "overhead": [MLPUnit],
        "compute": [Block],
        "frozen": [VisionEncoder, Block],
    }[workload]


def make_batch(
    workload: str, size: dict[str, Any], step: int, rank: int, world: int, device: torch.device
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Rank ``rank``'s rows of the global batch of ``step``: (inputs, targets)."""
    b = size["batch"]
    rows = slice(rank * b, (rank + 1) * b)
    if workload == "overhead":
        g = torch.Generator().manual_seed(SEED + step)
        x = torch.randn(b * world, size["dim"], generator=g)
        y = torch.randn(b * world, size["dim"], generator=g)
        return (x[rows].to(device),), y[rows].to(device)
    x, y = token_batch(step, b * world, size["seq"], size["vocab"], seed=SEED)
    if workload == "compute":
        return (x[rows].to(device),), y[rows].to(device)
    g = torch.Generator().manual_seed(SEED + step)
    patches = torch.randn(b * world, size["patches"], size["patch_dim"], generator=g)
    return (patches[rows].to(device), x[rows].to(device)), y[rows].to(device)


def loss_of(workload: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if workload == "overhead":
        return F.mse_loss(output, target)
    return F.cross_entropy(output.flatten(0, 1).float(), target.flatten())


def is_encoder_param(name: str) -> bool:
    return name.startswith("encoder.")


# ---- counting collectives -------------------------------------------------------------
class CollectiveCounter:
    """Wraps torch.distributed's collectives in this process and counts the unsharded
    elements and bytes each covers (outermost call only: a wrapper calling another is
    counted once)."""

    _NAMES: ClassVar[
        dict[str, tuple[str, tuple[str, int]]]
    ] = {  # name -> (kind, (keyword, position) of the unsharded tensor(s))
        "all_gather_into_tensor": ("all_gather", ("output_tensor", 0)),
        "all_gather_single": ("all_gather", ("output_tensor", 0)),
        "_all_gather_base": ("all_gather", ("output_tensor", 0)),
        "all_gather": ("all_gather", ("tensor_list", 0)),
        "reduce_scatter_tensor": ("reduce_scatter", ("input", 1)),
        "reduce_scatter_single": ("reduce_scatter", ("input", 1)),
        "_reduce_scatter_base": ("reduce_scatter", ("input", 1)),
        "reduce_scatter": ("reduce_scatter", ("input_list", 1)),
        "all_reduce": ("all_reduce", ("tensor", 0)),
    }

    def __init__(self) -> None:
        self._local = threading.local()
        self.reset()
        for name, (kind, where) in self._NAMES.items():
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(original, kind, where))

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


# ---- expected bytes --------------------------------------------------------------------
def expected_fsdp_elements(model: Any) -> dict[str, int]:
    """Unsharded elements per step that fsdp's buckets imply (padding included).

    ZeRO-3: a unit's sharded bucket is gathered in forward and again in backward; a root
    bucket (outside units, or tied across the boundary) once, kept until the end of
    backward; a frozen bucket once (forward only: it assumes no gradient flows through
    frozen units, true for an encoder at the input). Below ZeRO-3, each trainable bucket
    whose main weights are sharded but compute weights replicated is gathered once after
    the optimizer step. Every trainable bucket is reduce-scattered (sharded grads or main
    weights) or all-reduced (replicated)."""
    buffer = model.buffer
    root = set(model.hooks.root_groups)
    out = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for gid, group in enumerate(buffer.groups):
        total = buffer.layouts[gid].total_numel
        weights = group.model_weight_buffer
        sharding = buffer.sharding[gid]
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
            elif buffer.shard_group_size(gid) > 1:
                out["all_reduce"] += total
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


# ---- one rank ---------------------------------------------------------------------------
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
) -> dict[str, Any]:
    """One repetition on this rank: build, wrap, ``warmup`` steps, ``steps`` timed steps."""
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
    module = build_model(workload, size).to(device)
    n_trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    n_frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    probe = MemoryProbe(device)
    units = unit_classes(workload)
    frozen_sharded = 0 if no_shard_encoder else n_frozen
    result: dict[str, Any] = {"rank": rank, "world": world, "device": str(device)}

    model: Any
    if impl == "floor":
        model = module
        optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
        frozen_sharded = 0
    elif impl == "fsdp":
        from fsdp import fsdp_no_shard, fully_shard

        if no_shard_encoder:
            fsdp_no_shard(module.encoder)
        optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
        model, optimizer = fully_shard(
            module, optimizer, fsdp_unit_modules=units, zero_dp_strategy=strategy
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

    def one_step(step: int) -> float:
        inputs, target = make_batch(workload, size, step, rank, world, device)
        _sync(device)
        start = time.perf_counter()
        loss = loss_of(workload, model(*inputs), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        _sync(device)
        return time.perf_counter() - start

    result["wrapped_bytes"] = probe.current() - probe.baseline
    probe.reset_peak()
    for step in range(warmup):
        one_step(step)
    counter.reset()
    if impl == "fsdp":
        model.comm_stats(reset=True)
    profiler = _profiler(profile_dir, impl, workload, strategy, no_shard_encoder, rank)
    with profiler:
        times = [one_step(warmup + step) for step in range(steps)]
    result["step_s"] = times
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
    if impl == "fsdp":
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


# ---- driver -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    workload: str
    strategy: int  # 3 (ZeRO-3) or 2 (ZeRO-2)
    no_shard_encoder: bool = False

    @property
    def label(self) -> str:
        variant = "+no_shard" if self.no_shard_encoder else ""
        return f"{self.workload}{variant} ZeRO-{self.strategy}"


def _configs(workloads: Sequence[str], strategies: Sequence[int]) -> list[Config]:
    out = []
    for w in workloads:
        for s in strategies:
            out.append(Config(w, s))
            if w == "frozen":
                out.append(Config(w, s, no_shard_encoder=True))
    return out


def _megatron_available() -> bool:
    try:
        import megatron_fsdp  # noqa: F401
    except ImportError:
        return False
    return True


def run_benchmark(
    workloads: Sequence[str] = ("overhead", "compute", "frozen"),
    strategies: Sequence[int] = (3, 2),
    reps: int = 3,
    tiny: bool = False,
    world_size: int | None = None,
    device_type: str | None = None,
    impls: Sequence[str] | None = None,
    profile_dir: str | None = None,
    timeout: float = 600.0,
    log: Callable[[str], None] = print,
    sizes: dict[str, dict[str, Any]] | None = None,
    floor: bool = True,
) -> dict[str, Any]:
    """Run every configuration ``reps`` times, alternating peers, and aggregate.
    ``sizes`` overrides a workload's model sizes (by workload name); ``floor=False``
    skips the one-process floor."""
    cuda = device_type == "cuda" or (device_type is None and torch.cuda.is_available())
    device_type = "cuda" if cuda else "cpu"
    if world_size is None:
        world_size = torch.cuda.device_count() if cuda else 2
    if impls is None:
        impls = ["fsdp", "fsdp2"]
        if cuda and _megatron_available():
            impls.append("megatron_fsdp")
    configs = _configs(workloads, strategies)
    load_at_start = list(os.getloadavg())
    started = time.perf_counter()
    raw: dict[tuple[str, str], list[list[dict[str, Any]]]] = {}
    env = {"OMP_NUM_THREADS": "1"}
    for rep in range(reps):
        for workload in workloads:
            wl = WORKLOADS[workload]
            size = (sizes or {}).get(workload) or (wl.tiny if tiny else wl.full)
            steps = 2 if tiny else wl.steps
            warmup = 1 if tiny else wl.warmup
            # The floor: one process, one rank's batch, no wrapper.
            runs: list[tuple[Config | None, str]] = [(None, "floor")] if floor else []
            for cfg in (c for c in configs if c.workload == workload):
                order = list(impls[rep % len(impls) :]) + list(impls[: rep % len(impls)])
                for impl in order:
                    if impl == "megatron_fsdp" and cfg.no_shard_encoder:
                        continue
                    runs.append((cfg, impl))
            if rep % 2:
                runs.reverse()
            for cfg, impl in runs:
                world = 1 if impl == "floor" else world_size
                kwargs = {
                    "impl": impl,
                    "workload": workload,
                    "size": size,
                    "strategy": cfg.strategy if cfg else 3,
                    "no_shard_encoder": cfg.no_shard_encoder if cfg else False,
                    "steps": steps,
                    "warmup": warmup,
                    "profile_dir": profile_dir if rep == 0 else None,
                }
                t0 = time.perf_counter()
                ranks = run_distributed(
                    bench_rank,
                    world,
                    kwargs=kwargs,
                    timeout=timeout,
                    device_type=device_type,
                    env=env,
                )
                label = cfg.label if cfg else f"{workload} floor"
                med = statistics.median(_step_times(ranks))
                log(
                    f"rep {rep + 1}/{reps} {label:<28} {impl:<14} median step "
                    f"{med * 1e3:9.2f} ms  ({time.perf_counter() - t0:.1f} s)"
                )
                raw.setdefault((label if cfg else workload, impl), []).append(ranks)
    rows = _aggregate(configs, impls, raw, world_size)
    machine = machine_info()
    machine["load_average_at_start"] = load_at_start
    machine["wall_s"] = time.perf_counter() - started
    return {
        "machine": machine,
        "device_type": device_type,
        "world_size": world_size,
        "reps": reps,
        "tiny": tiny,
        "impls": list(impls),
        "workloads": {w: vars_of(WORKLOADS[w], tiny) for w in workloads},
        "rows": rows,
        "raw": {f"{k[0]}|{k[1]}": v for k, v in raw.items()},
    }


def vars_of(wl: Workload, tiny: bool) -> dict[str, Any]:
    return {
        "description": wl.description,
        "size": wl.tiny if tiny else wl.full,
        "steps": 2 if tiny else wl.steps,
        "warmup": 1 if tiny else wl.warmup,
    }


def _step_times(ranks: list[dict[str, Any]]) -> list[float]:
    """Per step, the slowest rank's time."""
    return [max(ts) for ts in zip(*(r["step_s"] for r in ranks), strict=True)]


def _aggregate(
    configs: list[Config],
    impls: Sequence[str],
    raw: dict[tuple[str, str], list[list[dict[str, Any]]]],
    world: int,
) -> list[dict[str, Any]]:
    rows = []
    for cfg in configs:
        floor_runs = raw.get((cfg.workload, "floor"), [])
        floor = _median_time(floor_runs) if floor_runs else None
        stats: dict[str, dict[str, Any]] = {}
        for impl in impls:
            runs = raw.get((cfg.label, impl))
            if not runs:
                continue
            r0 = runs[0][0]
            total = sum(r0["elements"].values()) + r0["elements"]["all_reduce"]
            traffic = total * (world - 1) / world
            row = {
                "config": cfg.label,
                "workload": cfg.workload,
                "strategy": cfg.strategy,
                "no_shard_encoder": cfg.no_shard_encoder,
                "impl": impl,
                "step_ms": _median_time(runs) * 1e3,
                "floor_ms": floor * 1e3 if floor else None,
                "peak_mb": statistics.median(max(r["peak_bytes"] for r in rs) for rs in runs)
                / 2**20,
                "peak_mb_per_rep": [max(r["peak_bytes"] for r in rs) / 2**20 for rs in runs],
                "gathered_mb": r0["bytes"]["all_gather"] / 2**20,
                "reduced_mb": (r0["bytes"]["reduce_scatter"] + r0["bytes"]["all_reduce"]) / 2**20,
                "elements": r0["elements"],
                "calls": r0["calls"],
                "traffic_elements": traffic,
                "theory_elements": r0["theory_elements"],
                "theory_formula": r0["theory_formula"],
                "traffic_vs_theory": traffic / r0["theory_elements"]
                if r0["theory_elements"]
                else None,
                "trainable_params": r0["trainable_params"],
                "frozen_params": r0["frozen_params"],
                "model_state_bound_mb": 16 * r0["trainable_params"] / world / 2**20,
            }
            if impl == "fsdp":
                row["expected_elements"] = r0["expected_elements"]
                row["comm_stats"] = r0["comm_stats"]
            stats[impl] = row
        ref = stats.get("fsdp2")
        for row in stats.values():
            row["time_vs_fsdp2"] = row["step_ms"] / ref["step_ms"] if ref else None
            row["time_vs_floor"] = row["step_ms"] / row["floor_ms"] if row["floor_ms"] else None
            row["mem_vs_fsdp2"] = (
                row["peak_mb"] / ref["peak_mb"] if ref and ref["peak_mb"] else None
            )
            rows.append(row)
    return rows


def _median_time(runs: list[list[dict[str, Any]]]) -> float:
    return statistics.median(t for ranks in runs for t in _step_times(ranks))


def machine_info() -> dict[str, Any]:
    model = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    info: dict[str, Any] = {
        "cpu": model,
        "nproc": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()),
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


# ---- output -----------------------------------------------------------------------------
def _load(avg: Sequence[float] | None) -> str:
    return "?" if not avg else " / ".join(f"{x:.2f}" for x in avg)


def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def markdown_table(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"{result['device_type'].upper()}, world size {result['world_size']}, "
        f"{result['reps']} repetitions; {m['cpu']}, {m['nproc']} cores, torch {m['torch']}; "
        f"load average (1/5/15 min) {_load(m.get('load_average_at_start'))} at the start, "
        f"{_load(m['load_average'])} at the end ({m['date_utc']}, "
        f"{m.get('wall_s', 0.0) / 60:.1f} min).",
        "",
        "| configuration | peer | step ms | ×FSDP2 | ×floor | peak MB/rank | ×FSDP2 "
        "| gathered MB/step | reduced MB/step | traffic / theory |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['config']} | {r['impl']} | {r['step_ms']:.1f} | {_fmt(r['time_vs_fsdp2'], '.2f')} "
            f"| {_fmt(r['time_vs_floor'], '.2f')} | {r['peak_mb']:.1f} "
            f"| {_fmt(r['mem_vs_fsdp2'], '.2f')} | {r['gathered_mb']:.2f} | {r['reduced_mb']:.2f} "
            f"| {_fmt(r['traffic_vs_theory'], '.4f')} |"
        )
    floors = {}
    for r in result["rows"]:
        floors[r["workload"]] = r["floor_ms"]
    lines.append("")
    lines.append(
        "Floor (one process, per-rank batch, no wrapper), median step: "
        + ", ".join(f"{w} {_fmt(v, '.1f')} ms" for w, v in floors.items())
        + "."
    )
    lines.append("")
    lines.append(
        "Theory: per-rank ring traffic 3·Ψ·(N−1)/N elements per step for ZeRO-3 "
        "(+Ψ_frozen·(N−1)/N when a frozen encoder is sharded), 2·Ψ·(N−1)/N for ZeRO-2; "
        "Ψ = trainable parameters. Bytes are counted by wrapping torch.distributed's "
        "collectives in every rank."
    )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    by = {(r["config"], r["impl"]): r for r in rows}
    fig, axes = plt.subplots(3, 1, figsize=(11, 11), sharex=True)
    width = 0.8 / (len(impls) + 1)
    xs = range(len(configs))
    panels = [
        ("step time / FSDP2's", "time_vs_fsdp2", [1.0, 0.8]),
        ("peak memory / FSDP2's", "mem_vs_fsdp2", [1.0]),
        ("traffic / theory", "traffic_vs_theory", [1.0]),
    ]
    for ax, (title, key, lines) in zip(axes, panels, strict=True):
        for j, impl in enumerate(impls):
            vals = [(by.get((c, impl)) or {}).get(key) or 0.0 for c in configs]
            ax.bar([x + j * width for x in xs], vals, width, label=impl)
        if key == "time_vs_fsdp2":
            floor = [
                ((by.get((c, "fsdp2")) or {}).get("floor_ms") or 0.0)
                / ((by.get((c, "fsdp2")) or {}).get("step_ms") or 1.0)
                for c in configs
            ]
            ax.bar([x + len(impls) * width for x in xs], floor, width, label="floor")
        for y in lines:
            ax.axhline(y, color="gray", linestyle="--", linewidth=0.8)
        ax.set_ylabel(title)
        ax.legend(fontsize=8)
    axes[-1].set_xticks([x + width * len(impls) / 2 for x in xs])
    axes[-1].set_xticklabels(configs, rotation=20, ha="right", fontsize=8)
    m = result["machine"]
    fig.suptitle(
        f"fsdp vs FSDP2, {result['device_type']} world size {result['world_size']} "
        f"({m['cpu']}, torch {m['torch']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_results(result: dict[str, Any], out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out / "compare.json",
        "md": out / "compare.md",
        "png": out / "compare.png",
    }
    paths["json"].write_text(json.dumps(result, indent=1, default=str))
    paths["md"].write_text(markdown_table(result) + "\n")
    plot(result, paths["png"])
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compare", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--workloads", default="overhead,compute,frozen", help="comma-separated subset"
    )
    parser.add_argument("--strategies", default="3,2", help="ZeRO stages to run: 3, 2 or both")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per configuration")
    parser.add_argument("--tiny", action="store_true", help="tiny models, 2 steps (smoke test)")
    parser.add_argument("--world-size", type=int, default=None, help="default: GPUs, or 2 on CPU")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--impls", default=None, help="comma-separated peers (default: all)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile every rank's timed steps in the first repetition (slows it down)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    for w in workloads:
        if w not in WORKLOADS:
            parser.error(f"unknown workload {w!r}; choose from {sorted(WORKLOADS)}")
    profile_dir = None
    if args.profile:
        profile_dir = str(args.out / "profiles")
        Path(profile_dir).mkdir(parents=True, exist_ok=True)
    result = run_benchmark(
        workloads,
        [int(s) for s in args.strategies.split(",")],
        reps=args.reps,
        tiny=args.tiny,
        world_size=args.world_size,
        device_type=args.device,
        impls=args.impls.split(",") if args.impls else None,
        profile_dir=profile_dir,
    )
    paths = write_results(result, args.out)
    print()
    print(markdown_table(result))
    print()
    for kind, path in paths.items():
        print(f"{kind}: {path}")


if __name__ == "__main__":
    main()
