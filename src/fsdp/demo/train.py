"""What every rank of the demo runs: train the GPT under ``fully_shard``, checkpoint it.

The elastic launcher (``launch.py``, or ``torchrun``) starts ``run_rank`` in each
rank's process with ``RANK``, ``WORLD_SIZE`` and the rendezvous address in the
environment. Rank 0 draws the
progress bar, writes ``metrics.json`` and returns the summary; the other ranks return
None.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn import functional as F
from tqdm import tqdm

from fsdp.demo.data import Corpus
from fsdp.demo.metrics import comm_bytes, memory_bytes, memory_kind
from fsdp.demo.model import Block, build_model, model_config
from fsdp.demo.options import DemoOptions
from fsdp.demo.summary import comm_bound_bytes, comm_bound_passes
from fsdp_ckpt import load_checkpoint, save_checkpoint
from fsdp_hooks import fully_shard

__all__ = ["METRICS_FILE", "run_rank"]

METRICS_FILE = "metrics.json"
WARMUP_STEPS = 20
MAX_GRAD_NORM = 1.0
MB = 2**20


def _learning_rate(step: int, peak: float) -> float:
    """Linear warm-up over the first steps, then constant: a resumed run continues the
    same schedule whatever its length."""
    return peak * min(1.0, (step + 1) / WARMUP_STEPS)


def _setup(device_type: str) -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    # The ranks on this machine share its cores; oversubscribing them slows everyone.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def _global_mean(value: torch.Tensor) -> float:
    total = value.detach().float().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _per_rank(value: float, device: torch.device) -> list[float]:
    mine = torch.tensor([value], dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [t.item() for t in everyone]


@record
def run_rank(options: DemoOptions) -> dict[str, Any] | None:
    device = _setup(options.device)
    try:
        return _train(options, device)
    finally:
        dist.destroy_process_group()


def _train(o: DemoOptions, device: torch.device) -> dict[str, Any] | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    # Every rank trains on o.batch_size sequences, however many ranks were launched and
    # by whom (fsdp-demo's --nproc, or torchrun across nodes).
    global_batch = o.global_batch(world)
    corpus = Corpus.load()
    cfg = model_config(corpus.vocab_size, o.seq_len)
    module = build_model(cfg, o.seed).to(device)
    n_params = sum(p.numel() for p in module.parameters())
    trainable_bytes = sum(
        p.numel() * p.element_size() for p in module.parameters() if p.requires_grad
    )
    bound_mb = comm_bound_bytes(o.strategy, trainable_bytes, world) / MB
    optimizer = torch.optim.AdamW(module.parameters(), lr=o.lr, betas=(0.9, 0.95))
    model, optimizer = fully_shard(
        module, optimizer, fsdp_unit_modules=[Block], zero_dp_strategy=o.strategy
    )
    start, history = 0, []
    if o.resume:
        extra = load_checkpoint(o.checkpoint, model, optimizer)
        if extra.get("chars") != corpus.chars:
            raise RuntimeError(f"{o.checkpoint} was trained on another vocabulary")
        start, history = int(extra["step"]), list(extra["history"])
    if rank == 0:
        print(
            f"fsdp-demo: {world} rank(s) on {device.type}, strategy {o.strategy}, GPT with "
            f"{n_params / 1e6:.2f}M parameters, {len(corpus.text) / 1e3:.0f}k characters of "
            f"text, global batch {global_batch}x{o.seq_len} ({o.batch_size} per rank), "
            f"steps {start}..{start + o.steps}",
            flush=True,
        )
    bar = tqdm(
        total=start + o.steps, initial=start, unit="step", disable=rank != 0, mininterval=0.5
    )
    model.reset_comm_stats()
    total_comm = history[-1]["comm_mb"] * MB if history else 0.0
    for step in range(start, start + o.steps):
        began = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step, o.lr)
        x, y = corpus.batch(step, global_batch, o.seq_len, rank, world, o.seed)
        sequences = x.shape[0]  # this rank's: o.batch_size
        logits = model(x.to(device))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = _global_mean(loss)  # also waits for this step's work on every rank
        elapsed = time.perf_counter() - began
        step_comm = comm_bytes(model.comm_stats(reset=True))
        total_comm += step_comm
        memory = _per_rank(memory_bytes(device) / MB, device)
        rank_sequences = [int(n) for n in _per_rank(sequences, device)]
        if not math.isfinite(mean_loss):
            raise FloatingPointError(
                f"the loss is {mean_loss} at step {step + 1}; try a smaller --lr"
            )
        history.append(
            {
                "step": step + 1,
                "loss": mean_loss,
                "step_ms": elapsed * 1e3,
                "tokens_per_s": sum(rank_sequences) * o.seq_len / elapsed,
                "sequences_per_rank": rank_sequences,
                "memory_mb": memory,
                "comm_mb": total_comm / MB,  # since the first step, resumed runs included
                "comm_step_mb": step_comm / MB,
                # The bound of this step's strategy and world size (a resumed run may differ).
                "comm_bound_mb": bound_mb,
                "comm_bound_passes": comm_bound_passes(o.strategy),
            }
        )
        bar.set_postfix_str(
            f"loss {mean_loss:.3f}, {history[-1]['tokens_per_s'] / 1e3:.1f}k tok/s, "
            f"{memory_kind(device)} {'/'.join(f'{m:.0f}' for m in memory)} MB, "
            f"sent {step_comm / MB:.1f} MB/rank a step",
            refresh=False,
        )
        bar.update()
    bar.close()
    extra = {
        "step": start + o.steps,
        "history": history,
        "chars": corpus.chars,
        "model": asdict(cfg),
        "strategy": o.strategy,
        "world_size": world,
    }
    # Asynchronous: training would go on here while the files are written.
    saving = save_checkpoint(o.checkpoint, model, optimizer, extra=extra, asynchronous=True)
    path = saving.wait()
    if rank != 0:
        return None
    summary = {
        "device": device.type,
        "memory_kind": memory_kind(device),
        "world_size": world,
        "batch_size": o.batch_size,
        "global_batch": global_batch,
        "strategy": o.strategy,
        "parameters": n_params,
        "checkpoint": str(path),
        "checkpoint_blocked_s": saving.blocked_s,
        "history": history,
    }
    (o.out / METRICS_FILE).write_text(json.dumps(summary, indent=1))
    return summary
