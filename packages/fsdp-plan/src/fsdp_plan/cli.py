"""``fsdp-plan``: per-rank bytes and bytes moved per step, before launch.

    fsdp-plan mypkg.model:build --world-size 1024 --strategy 3,2 --units Block

``module.path:factory`` names a callable that returns the model; it is called under
``torch.device("meta")``, so nothing is allocated. ``--units`` takes class names of the
factory's module or dotted class paths.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from fsdp_buffers import MixedPrecisionPolicy, ShardingStrategy
from fsdp_plan.accounting import OPTIMIZERS
from fsdp_plan.plan import PEAK_KEYS, Plan, plan
from fsdp_plan.sweep import parse_bytes, sweep

__all__ = ["main"]

# the figures, their sum, then host memory an asynchronous checkpoint stages
_MEMORY_ROWS = (*PEAK_KEYS, "peak", "checkpoint_staging")
_TRAFFIC_ROWS = ("all_gather", "reduce_scatter", "all_reduce")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fsdp-plan",
        description=(
            "Per-rank model-state bytes and bytes moved per step of fully_shard over "
            "--world-size ranks, from the real wrapping code run for one rank on the meta "
            "device over a fake process group (no GPU, no peers, no weights)."
        ),
    )
    p.add_argument(
        "model",
        help="module.path:factory (a callable returning the nn.Module), or a Hugging Face "
        "config.json / directory with one / transformers model type (e.g. llama): built on "
        "the meta device, its decoder layers as units unless --units is given",
    )
    p.add_argument("--world-size", type=int, required=True, help="data-parallel ranks")
    p.add_argument(
        "--dp-outer",
        type=int,
        default=1,
        help="hybrid sharding: replicas of the shard group (world-size / dp-outer ranks each)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks: the factory builds one tp rank's module (Megatron-Core "
        "marks: tensor_model_parallel, partition_dim); a Hugging Face model is split by its "
        "tensor-parallel plan",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks (an expert mesh; the factory builds one rank's experts)",
    )
    p.add_argument(
        "--outer-strategy",
        choices=("no_shard", "optim"),
        default="no_shard",
        help="outer_dp_sharding_strategy: replicate (HSDP) or also shard main weights and "
        "optimizer state across the replicas (fully-sharded HSDP; needs --strategy 3)",
    )
    p.add_argument(
        "--strategy",
        default="3",
        help="zero_dp_strategy: 0..3 or a Megatron/ZeRO name; comma-separated for several",
    )
    p.add_argument(
        "--units",
        default="",
        help="FSDP unit classes (comma-separated): names in the factory's module or dotted paths",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        default=None,
        help="cast the model to this dtype first (main weights and grads stay fp32)",
    )
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help="the optimizer whose state is planned; muon: torch.optim.Muon for every "
        "trainable >= 2-D parameter, placed whole on one rank each as fully_shard places "
        "them (the padding this adds is in the bytes moved), AdamW for the rest",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="with --seq-len: one rank's micro-batch of token ids, for activations (a "
        "meta-device forward; the model's forward must take the ids as its first argument)",
    )
    p.add_argument(
        "--seq-len", type=int, default=None, help="tokens per sequence (see --batch-size)"
    )
    p.add_argument("--double-buffer", action="store_true", help="fsdp_double_buffer=True")
    p.add_argument(
        "--communication-unit-size",
        type=int,
        default=None,
        metavar="ELEMENTS",
        help="suggested_communication_unit_size: coalesce consecutive units into groups of "
        "at least this many elements (default: fully_shard's, pairs of units under 65,536 "
        "elements under ZeRO-3, up to four under 131,072 below it; 0: one unit per "
        "collective)",
    )
    p.add_argument(
        "--prefetch-depth", type=int, default=1, help="units (groups) gathered ahead (default 1)"
    )
    p.add_argument(
        "--memory-per-device",
        metavar="SIZE",
        default=None,
        help="e.g. 80GiB: list every strategy x mesh (--strategy and --dp-outer ignored) "
        "whose peak fits, by bytes moved per step, and the cheapest one that does not fit",
    )
    p.add_argument("--json", metavar="FILE", default=None, help="also write the plans as JSON")
    return p


def _load_factory(spec: str):
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"fsdp-plan: model must be 'module.path:factory'; got {spec!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: models in the current directory
    try:
        module = importlib.import_module(module_name)
        factory = getattr(module, attr)
    except (ImportError, AttributeError) as err:
        raise SystemExit(f"fsdp-plan: cannot load {spec!r}: {err}") from err
    if not callable(factory):
        raise SystemExit(f"fsdp-plan: {spec!r} is not callable")
    return module, factory


def _units(names: str, module) -> list:
    out: list = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        if "." in name:
            out.append(name)
            continue
        cls = getattr(module, name, None)
        if cls is None:
            raise SystemExit(
                f"fsdp-plan: unit {name!r} is not a name in {module.__name__}; give a dotted "
                "class path (package.module.Class)"
            )
        out.append(cls)
    return out


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_table(plans: Sequence[Plan]) -> str:
    header = ["per rank", *(p.strategy for p in plans)]
    memory = [k for k in _MEMORY_ROWS if any(k in p.per_rank for p in plans)]
    rows = [
        [key, *(_human(p.per_rank[key]) if key in p.per_rank else "-" for p in plans)]
        for key in (*memory, *_TRAFFIC_ROWS)
    ]
    rows.insert(len(memory), ["per step (ring traffic)", *("" for _ in plans)])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(r, widths, strict=True))) for r in [header, *rows]]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = [f"{p.strategy}: ranks differ ({len(p.ranks) + 1} kinds)" for p in plans if p.ranks]
    return "\n".join([*lines, *notes])


def _build(factory, dtype):
    def build():
        with torch.device("meta"):
            model = factory()
        return model if dtype is None else model.to(_DTYPES[dtype])

    return build


def _sweep(args, build, units) -> int:
    budget = parse_bytes(args.memory_per_device)
    found = sweep(
        build,
        args.world_size,
        budget,
        ep=args.ep,
        tp=args.tp,
        optimizer=args.optimizer,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        fsdp_unit_modules=units or None,
        fsdp_double_buffer=args.double_buffer,
        suggested_communication_unit_size=args.communication_unit_size,
        prefetch_depth=args.prefetch_depth,
    )
    fits = [c for c in found if c.fits]
    print(
        f"fsdp-plan: {args.model} over {args.world_size} ranks, {_human(budget)} per device: "
        f"{len(fits)} of {len(found)} strategy x mesh choices fit"
    )
    header = ("strategy", "dp_outer", "peak", "moved per step")
    rows = [
        (c.plan.strategy, str(c.dp_outer), _human(c.plan.per_rank["peak"]), _human(c.traffic))
        for c in fits
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    misses = [c for c in found if not c.fits]
    if misses:
        first = min(misses, key=lambda c: c.traffic)
        print(
            f"cheapest that does not fit: {first.plan.strategy}, dp_outer {first.dp_outer}: "
            f"{first.why_not(budget)}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [{"fits": c.fits, "dp_outer": c.dp_outer, **c.plan.as_dict()} for c in found],
                indent=2,
            )
            + "\n"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if ":" in args.model:
        module, factory = _load_factory(args.model)
        build = _build(factory, args.dtype)
        units = _units(args.units, module)
    else:
        from fsdp_plan.hf import hf_builder

        hf_build, hf_units, _ = hf_builder(args.model, tp=args.tp)
        build = hf_build if args.dtype is None else (lambda: hf_build().to(_DTYPES[args.dtype]))
        units = [u.strip() for u in args.units.split(",") if u.strip()] or hf_units
    if args.memory_per_device is not None:
        return _sweep(args, build, units)
    strategies = [
        ShardingStrategy.parse(int(s) if s.strip().isdigit() else s.strip())
        for s in args.strategy.split(",")
    ]
    plans = []
    for strategy in strategies:
        plans.append(
            plan(
                build(),
                args.world_size,
                dp_outer=args.dp_outer,
                tp=args.tp,
                ep=args.ep,
                outer_dp_sharding_strategy=args.outer_strategy,
                optimizer=args.optimizer,
                batch_size=args.batch_size,
                seq_len=args.seq_len,
                fsdp_unit_modules=units or None,
                zero_dp_strategy=strategy,
                mixed_precision_policy=MixedPrecisionPolicy(),
                fsdp_double_buffer=args.double_buffer,
                suggested_communication_unit_size=args.communication_unit_size,
                prefetch_depth=args.prefetch_depth,
            )
        )
    print(f"fsdp-plan: {args.model} over {args.world_size} ranks, optimizer {args.optimizer}")
    print(format_table(plans))
    if args.json:
        Path(args.json).write_text(json.dumps([p.as_dict() for p in plans], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
