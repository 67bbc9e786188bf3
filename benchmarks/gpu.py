"""The GPU benchmark: a Llama-shaped ~1B model in bf16, fsdp against FSDP2 and the unwrapped
model, at world 1 and at world = the number of GPUs; plus the 49M GPT of the CPU benches.

    python -m benchmarks.gpu                     # every model, impl and world; a markdown table
    python -m benchmarks.gpu --batch 4 --seq 4096 --out gpu.md --json gpu.json
    python -m benchmarks.gpu --device cpu --tiny  # the plumbing on CPU (gloo, tiny sizes)

Peers, each in fresh rank processes (``fsdp_mesh.testing.run_distributed``), one GPU per
rank:

- ``fsdp``: ``fsdp.fully_shard`` ZeRO-3, the module in bf16 with fp32 main weights and
  main gradients (``MixedPrecisionPolicy()``); AdamW on the fp32 main weights. The rope
  tables stay fp32, as in the other two.
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every decoder layer and the root,
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, fp32 parameters; AdamW.
- ``plain`` (world 1 only): the unwrapped model, fp32 parameters under
  ``torch.autocast(bf16)``; AdamW.

The GPT of the CPU benches (``benchmarks.workloads``, "compute": 49M parameters, batch
2x64 tokens per rank) runs in fp32 for all three, as it does there.

Per run: median step time, tokens/s (all ranks), MFU, peak allocated and reserved memory
(``torch.cuda.max_memory_allocated/reserved``, from process start, so model states
included), and ``fsdp.plan``'s predicted per-rank peak for fsdp (model states + gathered
units + activations of a meta-device forward; no allocator overhead or kernel
workspaces). MFU = (6 N + 6 L s d) tokens / step time / peak: N the parameters (the tied
head counted once), L layers, s the sequence, d the attention width (causal attention,
forward and backward); peak 989 TFLOP/s (H100/H200 dense bf16) or ``--peak-tflops``.
A run that fails (out of memory, say) is a row that says so; the others still run.
Under the table, one line from ``alignment_probe``: a matmul on a weight two elements off
16-byte alignment against an aligned one (whether a bucket should align parameter
starts).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

__all__ = ["LlamaConfig", "LlamaLM", "main", "run"]

# Dense bf16 tensor-core peaks (no sparsity), by the name torch reports.
_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}
IMPLS = ("fsdp", "fsdp2", "plain")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b")
MODELS = ("llama1b", "gpt49m")


# ---- the Llama-shaped model (plain torch) ---------------------------------------------
@dataclass(frozen=True)
class LlamaConfig:
    """Llama 3.2 1B's shapes at the defaults (1.24B parameters, tied embeddings)."""

    vocab: int = 128_256
    dim: int = 2048
    hidden: int = 8192
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    rope_theta: float = 500_000.0
    max_seq: int = 8192


LLAMA_TINY = LlamaConfig(vocab=256, dim=64, hidden=128, layers=2, heads=4, kv_heads=2, max_seq=64)


def _rope(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = cfg.dim // cfg.heads
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(cfg.max_seq, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate the two halves of each head.
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.dim // cfg.heads
        self.q = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaLayer(nn.Module):
    """One decoder layer: the FSDP unit."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class LlamaLM(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(LlamaLayer(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.embed.weight
        cos, sin = _rope(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


# ---- one run, on every rank -----------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    model: str  # one of MODELS
    impl: str  # one of IMPLS
    world: int
    batch: int  # sequences per rank
    seq: int
    steps: int
    warmup: int
    tiny: bool


def _build(spec: Spec, device: torch.device) -> tuple[nn.Module, type[nn.Module], int, int, int]:
    """The model on ``device`` (fp32), its unit class, vocab, layers and attention width."""
    if spec.model == "llama1b":
        cfg = LLAMA_TINY if spec.tiny else LlamaConfig()
        if spec.seq > cfg.max_seq:
            cfg = LlamaConfig(**{**asdict(cfg), "max_seq": spec.seq})
        torch.manual_seed(0)
        with torch.device(device):
            return LlamaLM(cfg), LlamaLayer, cfg.vocab, cfg.layers, cfg.dim
    from benchmarks.workloads import WORKLOADS, build_model
    from fsdp_mesh.testing.models import Block

    size = dict(WORKLOADS["compute"].tiny if spec.tiny else WORKLOADS["compute"].full)
    size.update(seq=spec.seq)
    model = build_model("compute", size).to(device)
    return model, Block, size["vocab"], size["layers"], size["dim"]


def _bf16(spec: Spec) -> bool:
    return spec.model == "llama1b"


def _to_bf16(module: nn.Module) -> nn.Module:
    """``module`` in bf16 but for the Llama rope tables, which stay the fp32 ones FSDP2
    (which casts parameters only) and the autocast plain model use: cast and cast back,
    they would be bf16 roundings."""
    tables = {name: getattr(module, name) for name in ("cos", "sin") if hasattr(module, name)}
    module = module.to(torch.bfloat16)
    for name, table in tables.items():
        setattr(module, name, table)
    return module


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_rank(spec: Spec) -> dict[str, Any]:
    """Build, wrap, ``warmup`` then ``steps`` timed steps; this rank's figures."""
    import fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    module, unit, vocab, _layers, _dim = _build(spec, device)
    n_params = sum(p.numel() for p in module.parameters())
    bf16 = _bf16(spec)
    autocast: Any = contextlib.nullcontext
    if spec.impl == "fsdp":
        if bf16:
            module = _to_bf16(module)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        model, optimizer = fsdp.fully_shard(
            module,
            optimizer,
            fsdp_unit_modules=[unit],
            zero_dp_strategy=3,
            mixed_precision_policy=fsdp.MixedPrecisionPolicy(),
        )
    elif spec.impl == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

        mesh = init_device_mesh(device.type, (world,))
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if bf16
            else MixedPrecisionPolicy()
        )
        for sub in module.modules():
            if isinstance(sub, unit):
                fsdp2_fully_shard(sub, mesh=mesh, mp_policy=policy)
        fsdp2_fully_shard(module, mesh=mesh, mp_policy=policy)
        model = module
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    elif spec.impl == "plain":
        if world != 1:
            raise ValueError("the unwrapped model runs at world 1 only")
        model = module
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        if bf16:
            autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    else:
        raise ValueError(f"unknown impl {spec.impl!r}; choose from {IMPLS}")

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, vocab, (spec.batch, spec.seq + 1), generator=g).to(device)
        return tokens[:, :-1], tokens[:, 1:]

    def one_step(step: int) -> float:
        x, y = batch(step)
        _sync(device)
        start = time.perf_counter()
        with autocast():
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"step {step}: loss is {loss.item()}")
        return time.perf_counter() - start

    for step in range(spec.warmup):
        one_step(step)
    times = [one_step(spec.warmup + step) for step in range(spec.steps)]
    out: dict[str, Any] = {"rank": rank, "step_s": times, "params": n_params}
    if cuda:
        out["peak_allocated"] = torch.cuda.max_memory_allocated(device)
        out["peak_reserved"] = torch.cuda.max_memory_reserved(device)
        out["card"] = torch.cuda.get_device_name(device)
    return out


# ---- the planner's prediction ---------------------------------------------------------
def predicted_peak(spec: Spec) -> int | None:
    """``fsdp.plan``'s per-rank peak for the fsdp run of ``spec`` (the largest rank)."""
    if spec.impl != "fsdp":
        return None
    import fsdp

    with torch.device("meta"):
        module, unit, *_ = _build(spec, torch.device("meta"))
    if _bf16(spec):
        module = _to_bf16(module)
    result = fsdp.plan(
        module,
        spec.world,
        batch_size=spec.batch,
        seq_len=spec.seq,
        fsdp_unit_modules=[unit],
        zero_dp_strategy=3,
        mixed_precision_policy=fsdp.MixedPrecisionPolicy(),
    )
    return int(result.per_rank["peak"])


# ---- driving it -----------------------------------------------------------------------
def _flops_per_token(model: str, params: int, layers: int, dim: int, seq: int) -> float:
    del model
    return 6.0 * params + 6.0 * layers * seq * dim


def peak_tflops(card: str | None, given: float | None) -> float | None:
    if given is not None:
        return given
    if card is None:
        return None
    return next((v for k, v in _PEAK_TFLOPS.items() if k in card), None)


def run(spec: Spec, device_type: str, timeout: float, peak_given: float | None) -> dict[str, Any]:
    from fsdp_mesh.testing import run_distributed

    row: dict[str, Any] = {**asdict(spec), "device": device_type}
    try:
        row["predicted_peak"] = predicted_peak(spec)
    except Exception as err:  # the plan failing says so in the row; the run still happens
        row["plan_error"] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
    began = time.perf_counter()
    try:
        ranks = run_distributed(
            bench_rank, spec.world, args=(spec,), timeout=timeout, device_type=device_type
        )
    except BaseException as err:
        if isinstance(err, KeyboardInterrupt):
            raise
        text = str(err)
        # The exception's own line from the failing rank's traceback, else the summary.
        reason = next(
            (line for line in text.splitlines() if _EXCEPTION_LINE.match(line)),
            text.splitlines()[0] if text else type(err).__name__,
        )
        row["error"] = reason[:300]
        row["wall_s"] = time.perf_counter() - began
        return row
    row["wall_s"] = time.perf_counter() - began
    # A step takes as long as its slowest rank.
    steps = [max(r["step_s"][i] for r in ranks) for i in range(spec.steps)]
    median = statistics.median(steps)
    params = ranks[0]["params"]
    layers, dim = _model_shape(spec)
    tokens = spec.batch * spec.seq * spec.world
    row.update(
        step_s=median,
        tokens_per_s=tokens / median,
        params=params,
        peak_allocated=max((r.get("peak_allocated", 0) for r in ranks), default=0) or None,
        peak_reserved=max((r.get("peak_reserved", 0) for r in ranks), default=0) or None,
        card=ranks[0].get("card"),
    )
    peak = peak_tflops(row["card"], peak_given)
    if peak:
        flops = _flops_per_token(spec.model, params, layers, dim, spec.seq) * tokens
        row["mfu"] = flops / median / spec.world / (peak * 1e12)
    return row


def _model_shape(spec: Spec) -> tuple[int, int]:
    if spec.model == "llama1b":
        cfg = LLAMA_TINY if spec.tiny else LlamaConfig()
        return cfg.layers, cfg.dim
    from benchmarks.workloads import WORKLOADS

    size = WORKLOADS["compute"].tiny if spec.tiny else WORKLOADS["compute"].full
    return size["layers"], size["dim"]


def _gib(x: int | None) -> str:
    return "" if not x else f"{x / 2**30:.3g}"


# Below the table when it has a world-1 row of fsdp or FSDP2 (the measurement is as is).
WORLD1_NOTE = (
    "Note: world 1 is not like for like: fsdp shards nothing over a 1-rank group, while "
    "FSDP2 still unshards and reshards every unit in each forward and backward (copies and, "
    "in bf16, casts of its parameters; no collective in recent torch): compare the two at "
    "world > 1."
)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | impl | world | tokens/step | median step (ms) | tokens/s | MFU | "
        "peak alloc (GiB) | peak reserved (GiB) | plan peak (GiB) | note |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        tokens = r["batch"] * r["seq"] * r["world"]
        note = r.get("error") or r.get("plan_error") or ""
        lines.append(
            f"| {r['model']} | {r['impl']} | {r['world']} | {tokens} | "
            + (f"{r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | " if "step_s" in r else "| | ")
            + (f"{100 * r['mfu']:.1f}% | " if r.get("mfu") else "n/a | ")
            + f"{_gib(r.get('peak_allocated'))} | {_gib(r.get('peak_reserved'))} | "
            + f"{_gib(r.get('predicted_peak'))} | {note.replace('|', '/')} |"
        )
    notes = ""
    if any(r["world"] == 1 and r["impl"] in ("fsdp", "fsdp2") for r in rows):
        notes = f"\n{WORLD1_NOTE}\n"
    return head + "\n".join(lines) + "\n" + notes


def alignment_probe(device: torch.device, tiny: bool) -> str:
    """One line: a matmul (bf16 on CUDA) on a weight that starts two elements past a
    16-byte boundary, against the same weight aligned. A bucket packs parameters back to
    back, so a 1-D parameter whose length the world does not divide (dim 4096 at 3 or 6
    ranks) shifts every later parameter of its bucket off alignment; FSDP2 allocates
    each parameter on its own. This says whether aligning slot offsets is worth a
    layout change."""
    n, rows, reps = (64, 32, 3) if tiny else (4096, 8192, 20)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    storage = torch.randn(n * n + 8, device=device).to(dtype)
    x = torch.randn(rows, n, device=device).to(dtype)
    ms = {}
    for offset in (0, 2, 0, 2):  # twice each, alternated: the second of each is kept
        weight = storage[offset : offset + n * n].view(n, n)
        x @ weight.t()  # warm-up (cuBLAS heuristics, workspace)
        _sync(device)
        start = time.perf_counter()
        for _ in range(reps):
            x @ weight.t()
        _sync(device)
        ms[offset] = (time.perf_counter() - start) / reps * 1e3
    return (
        f"Alignment probe ({dtype}, [{rows}, {n}] @ [{n}, {n}]): {ms[0]:.3f} ms aligned, "
        f"{ms[2]:.3f} ms with the weight {2 * x.element_size()} bytes off 16-byte alignment "
        f"({ms[2] / ms[0]:.2f}x)."
    )


def _report(rows: list[dict[str, Any]], device: str, probe: str = "") -> str:
    card = next((r["card"] for r in rows if r.get("card")), device)
    tail = f"\n{probe}\n" if probe else ""
    return f"Card: {card}; torch {torch.__version__}\n\n{markdown_table(rows)}{tail}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny models (the plumbing, e.g. on CPU)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {MODELS}")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {IMPLS}")
    p.add_argument(
        "--worlds", default=None, help="comma list (default: 1 and the number of GPUs; cpu: 1,2)"
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="llama sequences per rank (default 3: about 60 GiB on one rank)",
    )
    p.add_argument("--seq", type=int, default=None, help="llama sequence length (default 4096)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; tiny 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the card's dense bf16 peak")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per run")
    p.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    p.add_argument("--json", type=Path, default=None, help="write every row as JSON here")
    return p.parse_args(argv)


def specs(a: argparse.Namespace) -> list[Spec]:
    if a.worlds:
        worlds = sorted({int(w) for w in a.worlds.split(",")})
    elif a.device == "cuda":
        worlds = sorted({1, max(1, torch.cuda.device_count())})
    else:
        worlds = [1, 2]
    steps = a.steps if a.steps is not None else (2 if a.tiny else 10)
    warmup = a.warmup if a.warmup is not None else (1 if a.tiny else 3)
    out = []
    for model in a.models.split(","):
        if model not in MODELS:
            raise SystemExit(f"--models: unknown {model!r}; choose from {MODELS}")
        if model == "llama1b":
            batch = a.batch or (2 if a.tiny else 3)
            seq = a.seq or (16 if a.tiny else 4096)
        else:
            from benchmarks.workloads import WORKLOADS

            size = WORKLOADS["compute"].tiny if a.tiny else WORKLOADS["compute"].full
            batch, seq = size["batch"], size["seq"]
        for world in worlds:
            for impl in a.impls.split(","):
                if impl not in IMPLS:
                    raise SystemExit(f"--impls: unknown {impl!r}; choose from {IMPLS}")
                if impl == "plain" and world != 1:
                    continue
                out.append(Spec(model, impl, world, batch, seq, steps, warmup, a.tiny))
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks.gpu: --device cuda but no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    rows = []
    for spec in specs(a):
        print(f"benchmarks.gpu: {spec.model} {spec.impl} world={spec.world} ...", flush=True)
        try:
            row = run(spec, a.device, a.timeout, a.peak_tflops)
        except Exception:
            row = {**asdict(spec), "error": traceback.format_exc().strip().splitlines()[-1]}
        rows.append(row)
        if a.out:  # after every run, so that a run cut off by a deadline leaves the rest
            a.out.write_text(_report(rows, a.device))
        print(
            "  "
            + (
                f"error: {row['error']}"
                if "error" in row
                else f"{row['step_s'] * 1e3:.1f} ms/step, {row['tokens_per_s']:.0f} tokens/s"
            ),
            flush=True,
        )
    try:
        probe = alignment_probe(torch.device(a.device), a.tiny)
    except Exception:
        probe = "Alignment probe failed: " + traceback.format_exc().strip().splitlines()[-1]
    text = _report(rows, a.device, probe)
    print(text)
    if a.out:
        a.out.write_text(text)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1, default=str))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    # Through the module's own name, so that the ranks unpickle ``Spec`` from it.
    from benchmarks.gpu import main as _main

    raise SystemExit(_main())
