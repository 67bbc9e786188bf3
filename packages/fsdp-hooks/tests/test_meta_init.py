"""Meta-device initialization (``init_model_with_meta_device=True``).

A model built under ``with torch.device("meta")`` and wrapped with the same seed must end
with exactly the weights of ``torch.manual_seed(s); Model()`` built eagerly in one
process (bit-exact, fp32 and bf16), whatever the world size and strategy; it must then
train exactly like the eagerly built one; each rank must materialize only its shards
plus about one FSDP unit (measured: see ``test_memory_bound``); and what cannot be
reproduced must be refused on every rank with a message that names it.

The references are built on the ranks themselves (the models are tiny): the rank
functions return the names that differ, or the numbers measured, and the parent asserts.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from fsdp_buffers import MixedPrecisionPolicy, fsdp_no_shard
from fsdp_hooks import fully_shard, fully_shard_model
from fsdp_mesh.testing import run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

CFG = GPTConfig(vocab_size=64, max_seq_len=8, dim=32, n_heads=4, n_layers=3)
SEED = 1234


# ---- helpers (on the ranks) -------------------------------------------------------------


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _eager_gpt(dtype: torch.dtype = torch.float32, cfg: GPTConfig = CFG) -> nn.Module:
    """The reference: built directly in ``dtype`` (the random numbers are drawn in it)."""
    with _default_dtype(dtype):
        torch.manual_seed(SEED)
        return GPT(cfg)


def _meta_gpt(dtype: torch.dtype = torch.float32, cfg: GPTConfig = CFG) -> nn.Module:
    with torch.device("meta"):
        model = GPT(cfg)
    return model.to(dtype)


def _wrap_meta(module: nn.Module, unit, strategy, seed: int = SEED, **kwargs):
    torch.manual_seed(seed)
    return fully_shard_model(
        module,
        fsdp_unit_modules=[unit],
        zero_dp_strategy=strategy,
        init_model_with_meta_device=True,
        **kwargs,
    )


def _gather(shard: torch.Tensor, rows: tuple[int, int] | None, shape) -> torch.Tensor:
    """A whole tensor from the ranks' dim-0 row ranges (uneven, so not DTensor's)."""
    local = shard.detach().clone()
    if rows is None:
        return local
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (rows, local))
    full = torch.empty(shape, dtype=local.dtype)
    for (r0, r1), part in parts:
        full[r0:r1] = part
    return full


def _distributed_params(wrapper) -> dict[str, torch.Tensor]:
    """The public view: ``wrapper.module``'s DTensor parameters, each made whole."""
    out = {}
    for name, p in wrapper.module.named_parameters():
        sharded = not p.placements[0].is_replicate()
        rows = wrapper.buffer.views.local_rows(name) if sharded else None
        out[name] = _gather(p.to_local(), rows, p.shape)
    return out


def _compute_weight_mismatches(wrapper, ref: dict[str, torch.Tensor]) -> list[str]:
    """This rank's rows of every compute (model-weight) parameter against the reference,
    bit for bit, in the compute dtype."""
    bad = []
    buffer = wrapper.buffer
    for name, gid, i, _p in buffer.named_params():
        buf = buffer.groups[gid].model_weight_buffer
        r0, r1 = buf.layout.local_rows(i, buf.shard_rank)
        expected = ref[name] if ref[name].dim() == 0 else ref[name][r0:r1]
        got = buf.local_param_view(i)
        if got.dtype != expected.dtype or not torch.equal(got, expected):
            bad.append(name)
    return bad


def _mismatches(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[str]:
    if got.keys() != ref.keys():
        return [f"names differ: {sorted(got.keys() ^ ref.keys())}"]
    return [n for n in ref if got[n].dtype != ref[n].dtype or not torch.equal(got[n], ref[n])]


def _buckets_left_gathered(wrapper) -> list[int]:
    return [
        gid
        for gid, g in enumerate(wrapper.buffer.groups)
        if g.model_weight_buffer.is_data_distributed and g.model_weight_buffer.has_unsharded_data
    ]


# ---- bit-exact parity of the weights ------------------------------------------------------


def _parity(strategies: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    eager = _eager_gpt()
    rng_after_eager = torch.get_rng_state()
    ref = {n: p.detach() for n, p in eager.named_parameters()}
    out = {}
    for strategy in strategies:
        wrapper = _wrap_meta(_meta_gpt(), Block, strategy)
        out[strategy] = {
            "rng_same": torch.equal(torch.get_rng_state(), rng_after_eager),
            "dtensor": _mismatches(_distributed_params(wrapper), ref),
            "compute": _compute_weight_mismatches(wrapper, ref),
            "gathered": _buckets_left_gathered(wrapper),
            "tied": wrapper.module.head.weight is wrapper.module.tok.weight,
            "sharded": any(g.model_weight_buffer.is_data_distributed for g in wrapper.buffer.groups)
            or any(
                wrapper.buffer.buckets[g].sharding.main_weights
                for g in range(len(wrapper.buffer.groups))
            ),
        }
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fp32_weights_equal_one_process_init(world):
    strategies = (3, 1)
    results = run_distributed(_parity, world, args=(strategies,), timeout=120)
    for rank, per_strategy in enumerate(results):
        for strategy, r in per_strategy.items():
            where = f"world={world} rank={rank} strategy={strategy}"
            assert r["dtensor"] == [], f"{where}: DTensor parameters differ: {r['dtensor']}"
            assert r["compute"] == [], f"{where}: compute weights differ: {r['compute']}"
            assert r["rng_same"], f"{where}: the random stream was not consumed as eagerly"
            assert r["gathered"] == [], f"{where}: buckets left allocated: {r['gathered']}"
            assert r["tied"], f"{where}: head and embedding are no longer tied"
            assert r["sharded"] == (world > 1), where


# ---- bf16 ---------------------------------------------------------------------------------


def _bf16(strategies: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    eager = _eager_gpt(torch.bfloat16)
    ref = {n: p.detach() for n, p in eager.named_parameters()}
    ref_main = {n: p.float() for n, p in ref.items()}
    out = {}
    for strategy in strategies:
        wrapper = _wrap_meta(_meta_gpt(torch.bfloat16), Block, strategy)
        out[strategy] = {
            "compute": _compute_weight_mismatches(wrapper, ref),
            "main": _mismatches(_distributed_params(wrapper), ref_main),
            "main_dtype": {p.dtype for p in wrapper.module.parameters()},
        }
    return out


def test_bf16_meta_model():
    """bf16 compute weights equal a model built in bf16 (``set_default_dtype``) bit for
    bit; the fp32 main weights (the DTensor parameters) are exactly their upcast."""
    results = run_distributed(_bf16, 2, args=((3, 1),), timeout=120)
    for rank, per_strategy in enumerate(results):
        for strategy, r in per_strategy.items():
            where = f"rank={rank} strategy={strategy}"
            assert r["compute"] == [], f"{where}: bf16 compute weights differ: {r['compute']}"
            assert r["main"] == [], f"{where}: fp32 main weights differ: {r['main']}"
            assert r["main_dtype"] == {torch.float32}, where


def _fp32_param_dtype_bf16(strategies: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    eager = _eager_gpt()
    ref = {n: p.detach() for n, p in eager.named_parameters()}
    ref_compute = {n: p.to(torch.bfloat16) for n, p in ref.items()}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    out = {}
    for strategy in strategies:
        wrapper = _wrap_meta(_meta_gpt(), Block, strategy, mixed_precision_policy=policy)
        out[strategy] = {
            "compute": _compute_weight_mismatches(wrapper, ref_compute),
            "main": _mismatches(_distributed_params(wrapper), ref),
        }
    return out


def test_fp32_meta_model_with_bf16_param_dtype():
    """FSDP2's ``param_dtype=torch.bfloat16`` on an fp32 meta model: initialization runs
    in fp32, so the fp32 main weights (the DTensor parameters) equal the eager fp32
    model bit for bit (not their bf16 rounding) and the compute weights are their bf16
    rounding."""
    results = run_distributed(_fp32_param_dtype_bf16, 2, args=((3, 1, 0),), timeout=120)
    for rank, per_strategy in enumerate(results):
        for strategy, r in per_strategy.items():
            where = f"rank={rank} strategy={strategy}"
            assert r["compute"] == [], f"{where}: bf16 compute weights differ: {r['compute']}"
            assert r["main"] == [], f"{where}: fp32 main weights differ: {r['main']}"


# ---- training after meta init ----------------------------------------------------------------


def _train(strategies: tuple[int, ...], steps: int = 3) -> dict[tuple[int, str], Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = 2
    out = {}
    for strategy in strategies:
        for init in ("eager", "meta"):
            module = _eager_gpt() if init == "eager" else _meta_gpt()
            torch.manual_seed(SEED)  # meta init draws from here; eager already has
            optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
            model, optimizer = fully_shard(
                module,
                optimizer,
                fsdp_unit_modules=[Block],
                zero_dp_strategy=strategy,
                init_model_with_meta_device=init == "meta",
            )
            losses = []
            for step in range(steps):
                x, y = token_batch(step, rows * world, CFG.max_seq_len, CFG.vocab_size)
                mine = slice(rank * rows, (rank + 1) * rows)
                loss = F.cross_entropy(model(x[mine]).flatten(0, 1), y[mine].flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
            out[(strategy, init)] = {"losses": losses, "params": _distributed_params(model)}
    return out


def test_training_after_meta_init_matches_normal_init():
    results = run_distributed(_train, 2, args=((3, 1),), timeout=120)
    for rank, r in enumerate(results):
        for strategy in (3, 1):
            eager, meta = r[(strategy, "eager")], r[(strategy, "meta")]
            where = f"rank={rank} strategy={strategy}"
            assert meta["losses"] == eager["losses"], (where, meta["losses"], eager["losses"])
            assert _mismatches(meta["params"], eager["params"]) == [], where
            assert len(set(meta["losses"])) == len(meta["losses"]), f"{where}: not training"


# ---- more module kinds: buffers, parent resets, frozen, no-shard, real parameters ------------


class Scaled(nn.Module):
    """Its own parameter and a buffer computed by reset_parameters (as rotary tables)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.empty(dim))
        self.register_buffer("freqs", torch.empty(dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gain, 1.0, 0.1)
        with torch.no_grad():
            n = self.freqs.numel()
            self.freqs.copy_(1.0 / 10000 ** (torch.arange(n, device=self.freqs.device) / n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain + self.freqs


class FeatureBlock(nn.Module):
    """An FSDP unit with BatchNorm (meta buffers) and a parent reset that re-initializes
    a child's weight after the children were built (run after them, as eagerly)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(dim)
        self.inner = nn.Linear(dim, dim)
        self.outer = nn.Linear(dim, dim)
        self.scaled = Scaled(dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.orthogonal_(self.outer.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(F.gelu(self.inner(self.scaled(self.norm(x)))))


class FeatureModel(nn.Module):
    def __init__(self, vocab: int = 24, dim: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.blocks = nn.ModuleList(FeatureBlock(dim) for _ in range(depth))
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        fsdp_no_shard(self.blocks[1])
        self.head = nn.Linear(dim, vocab)  # its own bias, and a weight tied below
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.frozen(x) * self.offset)


def _feature_model(device: str) -> nn.Module:
    with torch.device(device):
        model = FeatureModel()
    # Assigned after construction, on a real device in both cases: keeps its value.
    model.offset = nn.Parameter(torch.linspace(0.5, 1.5, 16))
    return model


def _features(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    torch.manual_seed(SEED)
    eager = _feature_model("cpu")
    ref = {n: p.detach() for n, p in eager.named_parameters()}
    ref_buffers = {n: b for n, b in eager.named_buffers()}
    out = []
    for config in configs:
        config = dict(config)
        strategy = config.pop("strategy")
        wrapper = _wrap_meta(_feature_model("meta"), FeatureBlock, strategy, **config)
        buffers = dict(wrapper.module.named_buffers())
        frozen = dict(wrapper.module.named_parameters())["frozen.weight"]
        out.append(
            {
                "dtensor": _mismatches(_distributed_params(wrapper), ref),
                "compute": _compute_weight_mismatches(wrapper, ref),
                "buffers": _mismatches(buffers, ref_buffers),
                "frozen_requires_grad": frozen.requires_grad,
                # blocks.1 was marked on the meta model: the mark survives materialization
                # (its groups exist) and keeps them replicated.
                "no_shard_replicated": {
                    name.split(".")[1]
                    for g in wrapper.buffer.groups
                    if g.fsdp_no_shard and not g.model_weight_buffer.is_data_distributed
                    for name in g.names
                }
                == {"1"}
                and all(
                    not g.model_weight_buffer.is_data_distributed
                    for g in wrapper.buffer.groups
                    if g.fsdp_no_shard
                ),
            }
        )
    return out


FEATURE_CONFIGS = [
    {"strategy": 0},  # no_shard: supported (everything replicated)
    {"strategy": 2},
    {"strategy": 3},
]


def test_buffers_parent_resets_frozen_no_shard_and_real_parameters():
    results = run_distributed(_features, 2, args=(FEATURE_CONFIGS,), timeout=120)
    for rank, per_config in enumerate(results):
        for config, r in zip(FEATURE_CONFIGS, per_config, strict=True):
            where = f"rank={rank} {config}"
            assert r["dtensor"] == [], f"{where}: parameters differ: {r['dtensor']}"
            assert r["compute"] == [], f"{where}: compute weights differ: {r['compute']}"
            assert r["buffers"] == [], f"{where}: buffers differ: {r['buffers']}"
            assert r["frozen_requires_grad"] is False, where
            assert r["no_shard_replicated"], where


# ---- what cannot be reproduced is refused -------------------------------------------------------


class NoReset(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))  # no reset_parameters: lost on meta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Forgetful(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.weight)  # forgets the bias


class Rotary(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(dim) / dim))


class RotaryForgetful(Rotary):
    def reset_parameters(self) -> None:
        pass


def _error_of(build, seed_offset_per_rank: bool = False) -> str:
    with torch.device("meta"):
        model = build()
    seed = SEED + (dist.get_rank() if seed_offset_per_rank else 0)
    try:
        _wrap_meta(model, nn.Linear, 3, seed=seed)
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _errors() -> dict[str, str]:
    return {
        "no_reset": _error_of(lambda: nn.Sequential(nn.Linear(8, 8), NoReset(8))),
        "forgetful": _error_of(lambda: nn.Sequential(nn.Linear(8, 8), Forgetful(8))),
        "buffer_no_reset": _error_of(lambda: nn.Sequential(nn.Linear(8, 8), Rotary(8))),
        "buffer_forgetful": _error_of(lambda: nn.Sequential(nn.Linear(8, 8), RotaryForgetful(8))),
        "seeds_differ": _error_of(lambda: nn.Sequential(nn.Linear(8, 8)), True),
    }


def test_clear_errors_on_every_rank():
    results = run_distributed(_errors, 2, timeout=120)
    expected = {
        "no_reset": ["ValueError", "'1.scale (NoReset)'", "reset_parameters()"],
        "forgetful": ["ValueError", "['1.bias']", "uninitialized"],
        "buffer_no_reset": ["ValueError", "1.inv_freq (buffer of Rotary)"],
        "buffer_forgetful": ["ValueError", "['1.inv_freq']", "uninitialized"],
        "seeds_differ": ["ValueError", "random generator differs", "torch.manual_seed"],
    }
    for rank, errors in enumerate(results):
        for case, needles in expected.items():
            for needle in needles:
                assert needle in errors[case], f"rank {rank} {case}: {errors[case]}"


# ---- memory: each rank holds its shards plus about one unit ---------------------------------------

MEM_WORLD = 4
MEM_CFG = GPTConfig(vocab_size=64, max_seq_len=16, dim=512, n_heads=8, n_layers=24)


def _allocator_curve(prof) -> tuple[list[tuple[int, int]], dict[str, tuple[int, int]]]:
    """Every CPU allocation and free the allocator reported while profiling, as (time,
    live bytes since the start) in time order, and the time ranges of fsdp's labels.
    At equal times allocations are counted before frees (an upper bound)."""
    events = list(prof.profiler.kineto_results.events())
    mem = sorted(
        ((e.start_ns(), -e.nbytes(), e.nbytes()) for e in events if e.name() == "[memory]"),
    )
    live, curve = 0, []
    for t, _order, nbytes in mem:
        live += nbytes
        curve.append((t, live))
    ranges = {
        e.name(): (e.start_ns(), e.end_ns()) for e in events if e.name().startswith("fsdp.meta")
    }
    return curve, ranges


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _return_freed_memory_to_the_kernel() -> None:
    """glibc keeps freed blocks below its (adaptive, up to 32 MiB) mmap threshold in
    its heap, resident, and how many depends on the heap's history; with a fixed 1 MiB
    threshold every large tensor is its own mapping, unmapped when freed, so RSS counts
    what is live (as CUDA's max_memory_allocated does), not what glibc caches."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def _memory() -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    _return_freed_memory_to_the_kernel()
    # Warm up: lazy imports and first-use caches are paid once per process, not per model.
    _wrap_meta(_meta_gpt(), Block, 3)

    # 1. The kernel's view: peak RSS growth while wrapping (no profiler running).
    with torch.device("meta"):
        module = GPT(MEM_CFG)
    rss_ok = _reset_peak_rss()  # False where there is no /proc (not Linux)
    rss_before = _rss_kib("VmRSS") if rss_ok else 0
    wrapper = _wrap_meta(module, Block, 3)
    rss_growth = (_rss_kib("VmHWM") - rss_before) * 1024 if rss_ok else None
    del wrapper, module
    gc.collect()

    # 2. The allocator's view: every allocation and free, in order.
    with torch.device("meta"):
        module = GPT(MEM_CFG)
    full_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    start, cpu_start = time.perf_counter(), time.process_time()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        wrapper = _wrap_meta(module, Block, 3)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    curve, ranges = _allocator_curve(prof)
    init_start, init_end = ranges["fsdp.meta_init"]
    before_init = [live for t, live in curve if t < init_start]
    at_init_start = before_init[-1] if before_init else 0
    groups = wrapper.buffer.groups
    return {
        "full_bytes": full_bytes,
        "weight_bytes": sum(g.model_weight_buffer.nbytes for g in groups)
        + sum(g.main_weight_buffer.nbytes for g in groups if g.main_weight_buffer is not None),
        "grad_bytes": sum(g.main_grad_buffer.nbytes for g in groups if g.main_grad_buffer),
        "unit_bytes": max(wrapper.buffer.buckets[g].unsharded_bytes for g in range(len(groups))),
        "peak_wrap": max(live for _t, live in curve),
        "peak_init": max(live for t, live in curve if init_start <= t <= init_end) - at_init_start,
        "held_after": curve[-1][1],
        "rss_growth": rss_growth,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
    }


def test_memory_bound():
    """With N = 4 ranks and a ~300 MB fp32 model, no rank ever holds much more than its
    quarter: peak growth of the allocator's live bytes while wrapping, gradients aside,
    is at most 1.5 x full/N, and the temporaries of initialize_from_meta (the unit being
    materialized, scratch for the tied head) at most 0.5 x full/N.

    Measured, not estimated: torch.profiler with ``profile_memory=True`` records every
    allocation and free of the CPU allocator (tensors, storage resizes, op temporaries),
    and the live bytes are their running sum; the ``fsdp.meta_init`` label delimits
    initialize_from_meta. The kernel's peak RSS (VmHWM, reset through
    /proc/self/clear_refs, in a first wrap without the profiler, whose own buffers take
    ~20 MB) is checked against the same bound as an independent witness: it also counts
    memory the allocator caches and Python objects, after a warm-up wrap of a tiny model
    has paid for lazy imports.
    The persistent main-grad shard (full/N for fp32 under ZeRO-3) is allocated by the
    wrapper whatever the initialization, so it is reported and subtracted."""
    results = run_distributed(_memory, MEM_WORLD, timeout=120)
    for rank, r in enumerate(results):
        full, n = r["full_bytes"], MEM_WORLD
        per_rank = full / n
        mib = 2**20
        print(
            f"rank {rank}: full {full / mib:.1f} MiB, full/N {per_rank / mib:.1f} MiB, "
            f"largest group {r['unit_bytes'] / mib:.1f} MiB | weights held "
            f"{r['weight_bytes'] / mib:.1f}, grads held {r['grad_bytes'] / mib:.1f} | "
            f"peak growth in wrap {r['peak_wrap'] / mib:.1f} "
            f"(minus grads {(r['peak_wrap'] - r['grad_bytes']) / mib:.1f}), "
            f"temporaries in meta init {r['peak_init'] / mib:.1f}, RSS growth "
            f"{r['rss_growth'] / mib if r['rss_growth'] is not None else float('nan'):.1f} "
            f"MiB | wrap {r['seconds']:.2f} s ({r['cpu_seconds']:.2f} s CPU)"
        )
        assert full > 250 * mib, "the model must be large enough for the bound to mean much"
        assert r["unit_bytes"] < 0.25 * per_rank  # the bound tests sharding, not luck
        assert r["weight_bytes"] <= 1.01 * per_rank, f"rank {rank}: weight shards too large"
        assert r["peak_wrap"] - r["grad_bytes"] <= 1.5 * per_rank, f"rank {rank}: {r}"
        assert r["peak_init"] <= 0.5 * per_rank, f"rank {rank}: {r}"
        held = r["weight_bytes"] + r["grad_bytes"]
        assert math.isclose(r["held_after"], held, rel_tol=0.02), f"rank {rank}: {r}"
        if r["rss_growth"] is not None:
            assert r["rss_growth"] - r["grad_bytes"] <= 1.5 * per_rank, f"rank {rank}: {r}"
