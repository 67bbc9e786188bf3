"""The demo's command line: parsed and checked before any rank starts.

Everything that can be wrong with the arguments is an argparse error (usage, the
problem, exit status 2) in the launching process, so no rank ever starts on bad input.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from fsdp_buffers import ShardingStrategy
from fsdp_ckpt.extra import read_extra

__all__ = ["CHECKPOINT_DIR", "DemoOptions", "build_parser", "parse_args", "under_torchrun"]

CHECKPOINT_DIR = "checkpoint"
DEFAULT_SEQ_LEN = 64
DEFAULT_OUT = Path("runs") / "fsdp-demo"


def under_torchrun() -> bool:
    """Whether this process is one rank started by ``torchrun`` (or any elastic agent):
    then the launcher, not ``--nproc``, decides how many ranks there are."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


@dataclass(frozen=True)
class DemoOptions:
    nproc: int  # local ranks fsdp-demo launches itself (unused under torchrun)
    device: str
    strategy: str  # the Megatron name, e.g. "optim_grads_params"
    steps: int
    out: Path
    resume: bool
    batch_size: int  # sequences per rank per step
    seq_len: int
    lr: float
    seed: int

    @property
    def checkpoint(self) -> Path:
        return self.out / CHECKPOINT_DIR

    def global_batch(self, world_size: int) -> int:
        """Sequences per step over all ranks: ``batch_size`` on each of the
        ``world_size`` ranks that actually train (whoever launched them)."""
        return self.batch_size * world_size


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fsdp-demo",
        description=(
            "Train a small character-level GPT on a text shipped with fsdp, on several "
            "ranks launched in this process by torch's elastic launcher, with a progress "
            "bar (loss, tokens/s, memory per rank, bytes communicated); then save a "
            "checkpoint and plot loss and memory per step."
        ),
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="ranks (default: 2 on CPU, every GPU); ignored under torchrun, which decides",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default: cpu")
    p.add_argument(
        "--strategy",
        default="optim_grads_params",
        help="no_shard, optim, optim_grads or optim_grads_params (ZeRO-3, the default); "
        "0..3 and zero1..zero3 are accepted too",
    )
    p.add_argument("--steps", type=int, default=100, help="optimizer steps to run (default 100)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default: ./{DEFAULT_OUT}")
    p.add_argument(
        "--resume",
        action="store_true",
        help=f"continue from OUT/{CHECKPOINT_DIR} (at any --nproc and --strategy) for --steps more",
    )
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help=f"characters per sequence (default {DEFAULT_SEQ_LEN}; on --resume, the checkpoint's)",
    )
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of AdamW")
    p.add_argument("--seed", type=int, default=0)
    return p


def _saved_seq_len(checkpoint: Path) -> int | None:
    """The sequence length the checkpoint's model was built for (None if unknown)."""
    try:
        return int(read_extra(checkpoint, 0, same_world=False)["user"]["model"]["max_seq_len"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def _positive(parser: argparse.ArgumentParser, name: str, value: float) -> None:
    if value <= 0:
        parser.error(f"{name} must be positive; got {value}")


def parse_args(argv: list[str] | None = None) -> DemoOptions:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        strategy = ShardingStrategy.parse(a.strategy.strip()).megatron_name
    except ValueError as err:
        parser.error(f"--strategy: {err}")
    torchrun = under_torchrun()
    if a.device == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            parser.error(
                f"--device cuda: no CUDA device is available (torch {torch.__version__}, "
                f"built for CUDA {torch.version.cuda or 'none'}); use --device cpu"
            )
        if torchrun:
            # torchrun, not --nproc, decides the ranks: one GPU per rank of this node.
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            if local > gpus:
                parser.error(
                    f"--device cuda: torchrun started {local} ranks on this node, which has "
                    f"{gpus} GPUs; pass --nproc-per-node {gpus} (or fewer) to torchrun"
                )
        nproc = gpus if a.nproc is None else a.nproc
        if nproc > gpus and not torchrun:
            parser.error(f"--nproc {nproc} on --device cuda needs {nproc} GPUs; found {gpus}")
    else:
        nproc = 2 if a.nproc is None else a.nproc
    if nproc < 1:
        parser.error(f"--nproc must be at least 1; got {nproc}")
    out = a.out.expanduser().absolute()
    seq_len = a.seq_len
    if a.resume:
        if not (out / CHECKPOINT_DIR).is_dir():
            parser.error(
                f"--resume: no checkpoint at {out / CHECKPOINT_DIR}; run once without --resume "
                "(or pass the --out of an earlier run)"
            )
        saved = _saved_seq_len(out / CHECKPOINT_DIR)
        if seq_len is None:
            seq_len = saved
        elif saved is not None and seq_len != saved:
            parser.error(
                f"--seq-len {seq_len}: the checkpoint at {out / CHECKPOINT_DIR} was trained "
                f"with --seq-len {saved} (its position table has {saved} rows); pass "
                f"--seq-len {saved} or leave it out"
            )
    seq_len = DEFAULT_SEQ_LEN if seq_len is None else seq_len
    for name, value in (
        ("--steps", a.steps),
        ("--batch-size", a.batch_size),
        ("--seq-len", seq_len),
        ("--lr", a.lr),
    ):
        _positive(parser, name, value)
    return DemoOptions(
        nproc=nproc,
        device=a.device,
        strategy=strategy,
        steps=a.steps,
        out=out,
        resume=a.resume,
        batch_size=a.batch_size,
        seq_len=seq_len,
        lr=a.lr,
        seed=a.seed,
    )
