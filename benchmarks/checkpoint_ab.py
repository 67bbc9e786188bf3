"""Checkpoints and the training loop: how long a save blocks it, and how fast it steps
while a save is written in the background, interleaved in one run.

Three arms, each round in a rotated order, on the same model and optimizer (world 2,
gloo, CPU unless ``--device cuda``):

* ``sync``: ``fsdp.save_checkpoint(path, model, opt)``; blocked for the whole save.
* ``ours``: ``fsdp.save_checkpoint(..., asynchronous=True)``; blocked until the state is
  staged, then ``--steps-during`` training steps while it writes, then ``wait()``.
* ``dcp``: ``dcp.async_save`` of ``model.state_dict()``/``optimizer.state_dict()`` with a
  gloo group of its own and ``fsdp.HostStager`` (reused host buffers, as ``ours``), then
  the same steps and ``result()``.

Per arm: the slowest rank's blocked time (median over rounds), its ratio to ``sync``'s,
the median step time while a background write was still in flight against the median
step with no save, and the time from the call to the published checkpoint (for the async
arms it includes the steps taken meanwhile). Host memory: the bytes
each async arm's stager holds (one copy of this rank's shards), and rank 0's RSS growth
over the first save of each arm (the stagers keep their buffers for the next save; RSS
is a rough figure: memory an earlier arm freed may be reused without growing it).

    uv run python -m benchmarks.checkpoint_ab --workload compute --strategy 3 --rounds 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import fsdp
from benchmarks.measure import _proc_status_kb
from benchmarks.workloads import WORKLOADS, build_model, loss_of, make_batch, unit_classes
from fsdp_ckpt.async_save import process_saver
from fsdp_ckpt.staging import staging_bytes
from fsdp_mesh.testing import harness_device

ARMS = ("sync", "ours", "dcp")


def _rss() -> int:
    return _proc_status_kb("VmRSS") * 1024


def checkpoint_rank(
    workload: str, size: dict[str, Any], strategy: int, root: str, rounds: int, during: int
) -> dict[str, Any]:
    device = harness_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build_model(workload, size).to(device)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    model, opt = fsdp.fully_shard(
        module, opt, fsdp_unit_modules=unit_classes(workload), zero_dp_strategy=strategy
    )
    step_no = 0

    def step() -> float:
        nonlocal step_no
        inputs, target = make_batch(workload, size, step_no, rank, world, device)
        start = time.perf_counter()
        loss_of(workload, model(*inputs), target).backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_no += 1
        return time.perf_counter() - start

    for _ in range(2):
        step()
    plain = [step() for _ in range(during)]
    group = dist.new_group(backend="gloo")
    stager = fsdp.HostStager()
    out: dict[str, Any] = {a: {"blocked": [], "total": [], "during": []} for a in ARMS}
    out["plain_steps"] = plain
    out["rss_growth"] = {}
    for r in range(rounds):
        order = ARMS[r % 3 :] + ARMS[: r % 3]
        for arm in order:
            path = Path(root) / f"{arm}_{r}"
            dist.barrier()
            rss = _rss()
            start = time.perf_counter()
            if arm == "sync":
                fsdp.save_checkpoint(path, model, opt)
                done = None
            elif arm == "ours":
                handle = fsdp.save_checkpoint(path, model, opt, asynchronous=True)
                done = handle.done
            else:
                state = {"model": model.state_dict(), "optim": opt.state_dict()}
                future = dcp.async_save(
                    state, checkpoint_id=path, async_stager=stager, process_group=group
                )
                done = future.done
            blocked = time.perf_counter() - start
            if r == 0:
                out["rss_growth"][arm] = _rss() - rss
            for _ in range(during if done is not None else 0):
                in_flight = not done()
                took = step()
                if in_flight:
                    out[arm]["during"].append(took)
            if arm == "ours":
                handle.wait()
            elif arm == "dcp":
                future.result()
            out[arm]["blocked"].append(blocked)
            out[arm]["total"].append(time.perf_counter() - start)
    out["staging_bytes"] = {"ours": process_saver().stager.nbytes, "dcp": stager.nbytes}
    out["shard_bytes"] = staging_bytes({"model": model.state_dict(), "optim": opt.state_dict()})
    return out


def main() -> None:
    from fsdp_mesh.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="compute", choices=sorted(WORKLOADS))
    parser.add_argument("--strategy", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-during", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--tiny", action="store_true", help="the smoke-test sizes")
    args = parser.parse_args()
    wl = WORKLOADS[args.workload]
    size = wl.tiny if args.tiny else wl.full
    root = Path(args.dir or tempfile.mkdtemp(prefix="fsdp_ckpt_ab_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        ranks = run_distributed(
            checkpoint_rank,
            2,
            args=(args.workload, size, args.strategy, str(root), args.rounds, args.steps_during),
            timeout=3600,
            device_type=args.device,
            env={"OMP_NUM_THREADS": "1"},
        )
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    def slowest(arm: str, key: str) -> list[float]:
        return [max(v) for v in zip(*(r[arm][key] for r in ranks), strict=True)]

    ms = lambda v: 1e3 * statistics.median(v) if v else float("nan")  # noqa: E731
    plain = ms([s for r in ranks for s in r["plain_steps"]])
    sync_blocked = ms(slowest("sync", "blocked"))
    print(
        f"\n{args.workload} ZeRO-{args.strategy}, world 2 ({args.device}), {args.rounds} rounds, "
        f"{args.steps_during} steps after each async save; step with no save: {plain:.0f} ms"
    )
    print(
        "| arm | blocked ms | blocked / sync | step during write ms (/ no save) | "
        "call to published ms | blocked ms per round |"
    )
    print("|---|---|---|---|---|---|")
    for arm in ARMS:
        blocked = ms(slowest(arm, "blocked"))
        during = ms([s for r in ranks for s in r[arm]["during"]])
        cell = "-" if arm == "sync" else f"{during:.0f} ({during / plain:.2f})"
        rounds = ", ".join(f"{1e3 * b:.0f}" for b in slowest(arm, "blocked"))
        print(
            f"| {arm} | {blocked:.0f} | {blocked / sync_blocked:.3f} | {cell} | "
            f"{ms(slowest(arm, 'total')):.0f} | {rounds} |"
        )
    mib = 1 << 20
    print(
        f"host staging per rank: ours {ranks[0]['staging_bytes']['ours'] / mib:.1f} MiB, "
        f"dcp {ranks[0]['staging_bytes']['dcp'] / mib:.1f} MiB (this rank's shards: "
        f"{ranks[0]['shard_bytes'] / mib:.1f} MiB); rank 0 RSS growth over the first save: "
        + ", ".join(f"{a} {v / mib:.1f} MiB" for a, v in ranks[0]["rss_growth"].items())
    )


if __name__ == "__main__":
    main()
