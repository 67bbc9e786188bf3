"""More of ``DistributedDataParallel`` (the Megatron-Core style adapter):

- ``accumulate_allreduce_grads_in_fp32`` on a bf16 module: ``main_grad`` is fp32 and
  holds the fp32 sum of the ranks' and microbatches' bf16 gradients (exactly what a
  one-process fp32 reference computes), within bf16 rounding of torch DDP's bf16
  gradients; training (fp32 main weights, AdamW) matches that reference.
- ``start_grad_sync()`` + ``finish_grad_sync()`` called explicitly after accumulating
  every microbatch under ``no_sync`` train exactly like torch DDP, and after a backward
  that already reduced they reduce nothing twice.
- ``zero_grad_buffer()`` zeroes every gradient and forgets the last step (flags, NaN
  records); ``zero_grad_buffer(zero_buffer=False)`` leaves the gradient memory as it
  is for the caller to zero.

All on CPU (gloo, even where GPUs are present), 2 ranks, a 2-layer GPT of width 32.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from fsdp_hooks import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from fsdp_mesh.testing import assert_same_training, run_distributed
from fsdp_mesh.testing.models import GPT, GPTConfig, token_batch

WORLD = 2
STEPS = 3
MICROBATCHES = 2
GLOBAL_BATCH = 8  # per microbatch
SEQ_LEN = 8
VOCAB = 64
LR = 1e-2
EPS = 1e-4  # see test_adapters.py: keeps Adam's updates of ~zero gradients small
BUCKET = 3000  # elements: several buckets for the tiny GPT
BF16_UNIT_ROUNDOFF = 2.0**-8  # bf16 keeps 8 significant bits: rounding errs by <= 2^-8
SETTINGS = {
    "all_reduce": {"use_distributed_optimizer": False, "overlap_grad_reduce": True},
    "all_reduce_no_overlap": {"use_distributed_optimizer": False, "overlap_grad_reduce": False},
    "distributed_optimizer": {"use_distributed_optimizer": True, "overlap_grad_reduce": True},
}


def build_gpt(dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ_LEN, dim=32, n_heads=4, n_layers=2)
    return GPT(cfg).to(dtype)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def rank_batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = token_batch(step * MICROBATCHES + micro, GLOBAL_BATCH, SEQ_LEN, VOCAB, seed=5)
    per_rank = GLOBAL_BATCH // WORLD
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[mine], y[mine]


def _ddp(module: nn.Module, **options: Any) -> DistributedDataParallel:
    return DistributedDataParallel(
        None, DistributedDataParallelConfig(bucket_size=BUCKET), module, **options
    )


def _main_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().clone() for n, p in module.named_parameters()}


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ---- (a) fp32 gradient accumulation on a bf16 module -----------------------------------


def _reference_bf16_fp32_grads() -> dict[str, Any]:
    """One process, every rank's microbatches: the bf16 model's gradients summed in fp32
    (per rank over its microbatches, scaled by 1/world, then over ranks: the order the
    adapter uses), fp32 main weights stepped by AdamW and rounded into the bf16 model.
    Also the first step's sum of |gradient| terms, the scale of bf16 rounding errors."""
    model = build_gpt(torch.bfloat16)
    master = {n: p.detach().float().clone().requires_grad_() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(master.values(), lr=LR, eps=EPS)
    losses, first_grads, magnitude = [], {}, {}
    for step in range(STEPS):
        total = {n: torch.zeros_like(m) for n, m in master.items()}
        abs_total = {n: torch.zeros_like(m) for n, m in master.items()}
        for rank in range(WORLD):
            mine = {n: torch.zeros_like(m) for n, m in master.items()}
            for micro in range(MICROBATCHES):
                model.zero_grad(set_to_none=True)
                loss = loss_fn(model, *rank_batch(step, micro, rank))
                loss.backward()
                if rank == dist.get_rank():
                    losses.append(loss.item())
                for n, p in model.named_parameters():
                    mine[n] += p.grad.float()
                    abs_total[n] += p.grad.float().abs() / WORLD
            for n in total:
                total[n] += mine[n] * (1.0 / WORLD)
        if step == 0:
            first_grads, magnitude = total, abs_total
        for n, m in master.items():
            m.grad = total[n]
        optimizer.step()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(master[n])
    return {
        "losses": losses,
        "first_grads": first_grads,
        "magnitude": magnitude,
        "params": _state(model),
    }


def _ours_bf16_fp32_grads(distributed: bool) -> dict[str, Any]:
    module = build_gpt(torch.bfloat16)
    model = _ddp(
        module,
        accumulate_allreduce_grads_in_fp32=True,
        use_distributed_optimizer=distributed,
        overlap_grad_reduce=True,
    )
    dtypes = {str(p.main_grad.dtype) for p in module.parameters()}
    if distributed:
        optimizer = torch.optim.AdamW(model.distributed_optimizer_params(), lr=LR, eps=EPS)
    else:
        # What a Megatron-Core optimizer does: fp32 main weights stepped on main_grad.
        master = {
            n: p.detach().float().clone().requires_grad_() for n, p in module.named_parameters()
        }
        optimizer = torch.optim.AdamW(master.values(), lr=LR, eps=EPS)
    rank = dist.get_rank()
    losses, first_grads = [], {}
    for step in range(STEPS):
        model.zero_grad_buffer()
        for micro in range(MICROBATCHES):
            last = micro == MICROBATCHES - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = loss_fn(model, *rank_batch(step, micro, rank))
                loss.backward()
            losses.append(loss.item())
        finalize_model_grads([model])
        if distributed:
            if step == 0:
                # Each rank's main_grad holds the reduced rows of its shard, zeros
                # elsewhere: the shards' sum over ranks is the whole reduced gradient.
                first_grads = _main_grads(module)
                for g in first_grads.values():
                    dist.all_reduce(g)
            optimizer.step()
            model.start_param_sync()
        else:
            if step == 0:
                first_grads = _main_grads(module)
            for n, p in module.named_parameters():
                master[n].grad = p.main_grad
            optimizer.step()
            with torch.no_grad():
                for n, p in module.named_parameters():
                    p.copy_(master[n])
    return {
        "main_grad_dtypes": dtypes,
        "losses": losses,
        "first_grads": first_grads,
        "params": _state(module),
    }


def _torch_ddp_bf16_first_grads() -> dict[str, torch.Tensor]:
    """torch DDP on the bf16 module: gradients accumulated and all-reduced in bf16."""
    module = build_gpt(torch.bfloat16)
    model = torch.nn.parallel.DistributedDataParallel(module)
    for micro in range(MICROBATCHES):
        last = micro == MICROBATCHES - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss_fn(model, *rank_batch(0, micro, dist.get_rank())).backward()
    return {n: p.grad.detach().float().clone() for n, p in module.named_parameters()}


def _bf16_fp32_accumulation() -> dict[str, Any]:
    return {
        "reference": _reference_bf16_fp32_grads(),
        "torch_ddp_first_grads": _torch_ddp_bf16_first_grads(),
        "all_reduce": _ours_bf16_fp32_grads(distributed=False),
        "distributed_optimizer": _ours_bf16_fp32_grads(distributed=True),
    }


def _bf16_grads_distributed_optimizer() -> dict[str, Any]:
    module = build_gpt(torch.bfloat16)
    model = _ddp(
        module,
        accumulate_allreduce_grads_in_fp32=False,
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
    )
    params = model.distributed_optimizer_params()
    loss_fn(model, *rank_batch(0, 0, dist.get_rank())).backward()
    finalize_model_grads([model])
    grads = [p.grad.to_local() for p in params]
    # Each rank's main_grad holds the reduced rows of its shard and zeros elsewhere.
    main = sum(p.main_grad.float().abs().sum() for p in module.parameters())
    mine = sum(g.abs().sum() for g in grads)
    totals = torch.stack([main, mine])
    dist.all_reduce(totals)
    return {
        "main_grad_dtypes": {str(p.main_grad.dtype) for p in module.parameters()},
        "grad_dtypes": {str(g.dtype) for g in grads},
        "exactly_bf16": all(torch.equal(g, g.to(torch.bfloat16).float()) for g in grads),
        "totals": totals.tolist(),
    }


def test_bf16_grads_reach_the_distributed_optimizer_cast_to_fp32():
    """``grad_reduce_in_fp32`` off with the distributed optimizer (Megatron-Core's
    bf16 gradient reduction): gradients accumulate and are reduced in bf16, and the
    optimizer's fp32 main weights get them cast to fp32 (as Megatron-Core does); before,
    attaching a bf16 gradient to an fp32 parameter failed. The cast is exact, so the
    optimizer's gradients are the reduced bf16 main grads: their absolute sums over all
    ranks agree to fp32 summation order (rtol 1e-5)."""
    for rank, r in enumerate(
        run_distributed(_bf16_grads_distributed_optimizer, WORLD, timeout=120, device_type="cpu")
    ):
        assert r["main_grad_dtypes"] == {"torch.bfloat16"}, (rank, r)
        assert r["grad_dtypes"] == {"torch.float32"}, (rank, r)
        assert r["exactly_bf16"], rank
        main, mine = r["totals"]
        assert main > 0 and abs(main - mine) <= 1e-5 * main, (rank, r)


def test_bf16_module_accumulates_and_reduces_grads_in_fp32():
    """Tolerances. Gradients: the adapter and the reference add the same bf16 terms in
    fp32 in the same order (2 ranks: a + b is commutative), so they agree to fp32
    rounding (rtol 1e-6); a bf16 gradient buffer would round each sum to 8 significant
    bits, off by up to 2^-8 relative, which the test checks is far outside that
    tolerance. torch DDP rounds to bf16 at each of at most 3 steps (microbatch sum, the
    1/world scaling, the all-reduce sum), each off by at most 2^-8 of a value no larger
    than the sum of |gradient| terms: so |ours - torch DDP| <= 3 * 2^-8 * sum|g|, checked
    element by element. Training: both sides step the same fp32 main weights with
    AdamW; what can differ is an fp32 last bit (Adam's loop over a DTensor shard versus
    a whole tensor), which may flip the rounding of a main weight into its bf16
    parameter: one bf16 unit in the last place, at most 2^-7 relative."""
    for rank, out in enumerate(
        run_distributed(_bf16_fp32_accumulation, WORLD, timeout=120, device_type="cpu")
    ):
        ref, ddp_grads = out["reference"], out["torch_ddp_first_grads"]
        for setting in ("all_reduce", "distributed_optimizer"):
            got, where = out[setting], f"rank={rank} {setting}"
            assert got["main_grad_dtypes"] == {"torch.float32"}, where
            assert got["first_grads"].keys() == ref["first_grads"].keys(), where
            bf16_buffer_would_differ = False
            for n, want in ref["first_grads"].items():
                have = got["first_grads"][n]
                torch.testing.assert_close(
                    have, want, rtol=1e-6, atol=1e-9, msg=lambda m, n=n, w=where: f"{w} {n}: {m}"
                )
                bound = 3 * BF16_UNIT_ROUNDOFF * ref["magnitude"][n] + 1e-12
                excess = (have - ddp_grads[n]).abs() - bound
                assert excess.max() <= 0, f"{where} {n}: off torch DDP by {excess.max()} > bound"
                rounded = want.bfloat16().float()
                bf16_buffer_would_differ |= not torch.allclose(rounded, want, rtol=1e-6, atol=1e-9)
            assert bf16_buffer_would_differ, "the check cannot tell fp32 from bf16 sums"
            torch.testing.assert_close(
                torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=2**-7, atol=0
            )
            for n, want in ref["params"].items():
                assert got["params"][n].dtype == torch.bfloat16, (where, n)
                torch.testing.assert_close(
                    got["params"][n].float(),
                    want.float(),
                    rtol=2**-7,
                    atol=1e-6,
                    msg=lambda m, n=n, w=where: f"{w} {n}: {m}",
                )


# ---- (b) start_grad_sync + finish_grad_sync, explicitly ---------------------------------


def _train_torch_ddp() -> dict[str, Any]:
    module = build_gpt()
    model = torch.nn.parallel.DistributedDataParallel(module)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        for micro in range(MICROBATCHES):
            last = micro == MICROBATCHES - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = loss_fn(model, *rank_batch(step, micro, dist.get_rank()))
                loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "params": _state(module)}


def _reductions(model: DistributedDataParallel) -> int:
    stats = model.comm_stats()
    return int(stats["all_reduce"]["calls"] + stats["reduce_scatter"]["calls"])


def _train_explicit_sync(setting: dict[str, bool], last_outside_no_sync: bool) -> dict[str, Any]:
    """Every microbatch under ``no_sync`` (or the last outside it), then
    ``start_grad_sync()`` and ``finish_grad_sync()`` by hand; counts the reductions
    each issued."""
    module = build_gpt()
    model = _ddp(module, **setting)
    distributed = setting["use_distributed_optimizer"]
    params = model.distributed_optimizer_params() if distributed else list(module.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR, eps=EPS)
    losses, by_backward, by_start, by_finish = [], 0, 0, 0
    for step in range(STEPS):
        model.zero_grad_buffer()
        for micro in range(MICROBATCHES):
            inside = not (last_outside_no_sync and micro == MICROBATCHES - 1)
            with model.no_sync() if inside else contextlib.nullcontext():
                loss = loss_fn(model, *rank_batch(step, micro, dist.get_rank()))
                loss.backward()
            losses.append(loss.item())
        before = _reductions(model)
        model.start_grad_sync()
        started = _reductions(model)
        model.finish_grad_sync()
        finished = _reductions(model)
        by_backward, by_start = by_backward + before, by_start + started - before
        by_finish += finished - started
        model.comm_stats(reset=True)
        if distributed:
            optimizer.step()
            model.start_param_sync()
        else:
            model.copy_main_grads_to_grads()
            optimizer.step()
            optimizer.zero_grad()
    return {
        "losses": losses,
        "params": _state(module),
        "reductions": {"backward": by_backward, "start": by_start, "finish": by_finish},
    }


def _explicit_sync() -> dict[str, Any]:
    out: dict[str, Any] = {"reference": _train_torch_ddp()}
    for name, setting in SETTINGS.items():
        out[name] = _train_explicit_sync(setting, last_outside_no_sync=False)
    out["after_overlapped_backward"] = _train_explicit_sync(
        SETTINGS["all_reduce"], last_outside_no_sync=True
    )
    return out


def test_explicit_start_and_finish_grad_sync_match_torch_ddp():
    for rank, out in enumerate(
        run_distributed(_explicit_sync, WORLD, timeout=120, device_type="cpu")
    ):
        ref = out["reference"]
        for name in (*SETTINGS, "after_overlapped_backward"):
            assert_same_training(out[name], ref, where=f"rank={rank} {name}", loss_atol=1e-6)
        for name in SETTINGS:
            # Nothing was reduced inside no_sync; start_grad_sync reduced every bucket
            # (one or more a step); finish_grad_sync had nothing left.
            counts = out[name]["reductions"]
            assert counts["backward"] == 0 and counts["finish"] == 0, (rank, name, counts)
            assert counts["start"] >= STEPS, (rank, name, counts)
        # The overlapped backward already reduced every bucket: the explicit calls
        # reduce nothing twice.
        counts = out["after_overlapped_backward"]["reductions"]
        assert counts["backward"] > STEPS and counts["start"] == counts["finish"] == 0, counts


# ---- (c) zero_grad_buffer ------------------------------------------------------------


def _one_backward(model: DistributedDataParallel, step: int = 0) -> None:
    loss_fn(model, *rank_batch(step, 0, dist.get_rank())).backward()


def _all(module: nn.Module, predicate) -> bool:
    return all(bool(predicate(p)) for p in module.parameters())


def _zero_grad_buffer(distributed: bool) -> dict[str, Any]:
    module = build_gpt()
    model = _ddp(
        module,
        use_distributed_optimizer=distributed,
        overlap_grad_reduce=True,
        check_for_nan_in_grad=True,
    )
    params = model.distributed_optimizer_params() if distributed else []
    out: dict[str, Any] = {}
    _one_backward(model)
    model.finish_grad_sync()
    first = _main_grads(module)
    out["first_nonzero"] = any(bool(g.abs().sum() > 0) for g in first.values())

    # zero_buffer=False: the memory is the caller's to zero; the state is reset.
    for p in module.parameters():
        p.grad = torch.ones_like(p)
        p.grad_added_to_main_grad = True
    model.zero_grad_buffer(zero_buffer=False)
    kept = _main_grads(module)
    out["kept_memory"] = all(torch.equal(kept[n], g) for n, g in first.items())
    out["kept_reset_grads"] = _all(module, lambda p: p.grad is None)
    out["kept_reset_flags"] = _all(module, lambda p: not p.grad_added_to_main_grad)
    with torch.no_grad():  # the caller zeroes it, as an optimizer owning views would
        for p in module.parameters():
            p.main_grad.zero_()
    _one_backward(model)
    model.finish_grad_sync()
    again = _main_grads(module)
    out["caller_zeroed_then_same"] = all(torch.equal(again[n], g) for n, g in first.items())

    # zero_grad_buffer(): every gradient is zero, so is what the optimizer reads.
    for p in module.parameters():
        p.grad_added_to_main_grad = True
    model.zero_grad_buffer()
    out["zeroed"] = _all(module, lambda p: torch.count_nonzero(p.main_grad) == 0)
    out["zeroed_reset_grads"] = _all(module, lambda p: p.grad is None)
    out["zeroed_reset_flags"] = _all(module, lambda p: not p.grad_added_to_main_grad)
    out["optimizer_grads_zero"] = all(
        torch.count_nonzero(p.grad.to_local()) == 0 for p in params if p.grad is not None
    )
    # The next step starts from nothing: the same batch gives the same gradients.
    _one_backward(model)
    model.finish_grad_sync()
    fresh = _main_grads(module)
    out["fresh_same"] = all(torch.equal(fresh[n], g) for n, g in first.items())
    # It also forgets a NaN seen by a backward whose step was abandoned.
    model.zero_grad_buffer()
    (loss_fn(model, *rank_batch(1, 0, dist.get_rank())) * float("nan")).backward()
    model.zero_grad_buffer()
    _one_backward(model)
    try:
        model.finish_grad_sync()
        out["nan_forgotten"] = True
    except RuntimeError as err:
        out["nan_forgotten"] = str(err)
    return out


def _zero_grad_buffer_both() -> dict[str, Any]:
    return {
        "all_reduce": _zero_grad_buffer(distributed=False),
        "distributed_optimizer": _zero_grad_buffer(distributed=True),
    }


def test_zero_grad_buffer_zeroes_and_zero_buffer_false_leaves_memory():
    for rank, out in enumerate(
        run_distributed(_zero_grad_buffer_both, WORLD, timeout=120, device_type="cpu")
    ):
        for setting, got in out.items():
            failed = [k for k, v in got.items() if v is not True]
            assert not failed, f"rank={rank} {setting}: {failed} ({got})"
