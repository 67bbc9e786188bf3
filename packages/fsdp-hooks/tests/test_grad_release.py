"""Released gradients (Note [released gradients] in ``fsdp_buffers.bucket_grads``).

Under ZeRO-2/3 the sharded main grads exist only from a backward's reduction until the
gradients are cleared, as FSDP2's do:

* Memory: after ``optimizer.zero_grad()`` no storage of any sharded main-grad buffer is
  alive (a storage weak reference expires); after ``zero_grad(set_to_none=False)`` it
  stays, zeroed, as torch keeps gradients then. ZeRO-0/1 keep theirs.
* Parity, step by step within 1e-5 with one process training on the whole global batch,
  on a schedule that walks every path: two microbatches per step, ``clip_grad_norm_``,
  ``zero_grad(set_to_none=False)`` followed by a step without backward (zero gradients
  applied), ``zero_grad()`` followed by a step without backward (skipped), under ZeRO-2
  and ZeRO-3 and, on a 2 x 2 mesh, HSDP and fully-sharded HSDP.
* A ``.grad`` someone kept stays a valid tensor: it reads zeros after ``zero_grad()``
  and the next backward's gradients after it (the same object follows, as the
  optimizer's ``.grad`` does); a kept reference to the old storage keeps its values.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn import functional as F

from fsdp_buffers import MixedPrecisionPolicy
from fsdp_hooks import fully_shard
from fsdp_mesh import build_device_mesh
from fsdp_mesh.testing import (
    assert_losses_close,
    assert_tensors_close,
    mean_over_ranks,
    run_distributed,
)
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

CFG = GPTConfig(vocab_size=48, max_seq_len=8, dim=16, n_heads=2, n_layers=2)
K = 2  # microbatches per step
M = 2  # rows per microbatch per rank
LR = 1e-2
MAX_NORM = 1.0
EPS = 1e-3  # see test_parity.py: GPT's qkv key bias gets rounding-noise gradients
# Per step: (backward?, clip?, set_to_none of the zero_grad after the step).
SCHEDULE = (
    (True, False, True),
    (True, True, False),
    (False, False, True),  # after set_to_none=False: zero gradients applied
    (False, False, True),  # after set_to_none=True: every parameter skipped
    (True, True, True),
    (True, False, True),
)


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=0.1)


def _batch(step, world):
    return token_batch(step, world * K * M, CFG.max_seq_len, CFG.vocab_size)


def _reference(world):
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = _optimizer(model.parameters())
    losses, norms = [], []
    for step, (backward, clip, to_none) in enumerate(SCHEDULE):
        if backward:
            x, y = _batch(step, world)
            total = 0.0
            for j in range(K):
                # Microbatch j of every rank: rows [r*K*M + j*M, +M) for each r.
                rows = torch.cat(
                    [torch.arange(r * K * M + j * M, r * K * M + (j + 1) * M) for r in range(world)]
                )
                loss = F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten()) / K
                loss.backward()
                total += loss.item()
            losses.append(total)
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad(set_to_none=to_none)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _grad_buffers(model):
    """The sharded main-grad buffers and the optimizer's cast copies of them."""
    bufs = [g.main_grad_buffer for g in model.buffer.groups]
    bufs += [b.grads.optimizer_grad_copy for b in model.buffer.buckets]
    return [b for b in bufs if b is not None and b.is_data_distributed]


def _live_storages(model):
    """Weak references to the storages of the gradient buffers allocated now (reading
    ``.data`` of a released one would allocate it)."""
    # (getattr: the same check runs, and fails, on a version without released buffers)
    return [
        StorageWeakRef(b.data.untyped_storage())
        for b in _grad_buffers(model)
        if not getattr(b, "is_released", False)
    ]


def _released(weakrefs, timeout=10.0):
    """Whether every storage in ``weakrefs`` is freed, waiting up to ``timeout`` s for
    gloo to drop its own references.

    fsdp drops its references inside ``zero_grad``, but a gloo collective's work still
    holds its tensors after ``wait()`` returns: its worker thread releases them only
    after marking the work complete, and freeing a tensor whose Python object C++
    owns then needs the GIL, which this thread holds while it runs. So expiry is
    polled, with the GIL released between reads; a reference fsdp kept never expires
    and fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not all(w.expired() for w in weakrefs):
        if time.monotonic() > deadline:
            return False
        time.sleep(1e-3)  # releases the GIL for gloo's worker thread
    return True


def _train(scenario, world):
    """Train on the schedule; check what is allocated after each zero_grad."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = GPT(CFG)
    kwargs = {"fsdp_unit_modules": [Block], "suggested_communication_unit_size": 0}
    strategy = int(scenario[-1])
    if scenario.startswith(("hsdp", "full")):
        kwargs["device_mesh"] = build_device_mesh(dp_outer=2, dp_shard=2).device_mesh
        kwargs["dp_shard_dim"], kwargs["dp_outer_dim"] = "dp_shard", "dp_outer"
        full = scenario.startswith("full")
        kwargs["outer_dp_sharding_strategy"] = "optim" if full else "no_shard"
    if scenario.startswith("bf16grad"):  # bf16 main grads: the optimizer's fp32 cast copy
        kwargs["mixed_precision_policy"] = MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16)
    model, opt = fully_shard(
        module, _optimizer(module.parameters()), zero_dp_strategy=strategy, **kwargs
    )
    sharded = strategy >= 2
    losses, norms, stored, reused = [], [], [], []
    for step, (backward, clip, to_none) in enumerate(SCHEDULE):
        if backward:
            x, y = _batch(step, world)
            total = torch.zeros(())
            for j in range(K):
                start = rank * K * M + j * M
                loss = (
                    F.cross_entropy(
                        model(x[start : start + M]).flatten(0, 1), y[start : start + M].flatten()
                    )
                    / K
                )
                loss.backward()
                total += loss.detach()
            losses.append(mean_over_ranks(total))
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        tracker = opt._fsdp_local_step
        reused.append(tracker.last_step_was_local and tracker.last_plan_was_reused)
        live = _live_storages(model)
        assert bool(live) == (sharded and (backward or not SCHEDULE[step - 1][2])), scenario
        opt.zero_grad(set_to_none=to_none)
        # Released where nothing holds the gradients (set_to_none), kept (zeroed) where
        # the optimizer's .grad still does.
        stored.append((to_none, [_released([w]) if to_none else w.expired() for w in live]))
        if not to_none:
            for p in model.parameters():
                assert p.grad is not None and not p.grad.to_local().any(), scenario
    params = model.buffer.views.full_parameters()
    return (losses, norms, params, stored, reused) if rank == 0 else None


def _check(result, reference, scenario):
    losses, norms, params, stored, reused = result
    # The local step's reused plan (same gradient objects) read gradients that had
    # been released and came back in new storage: the parity below covers it.
    assert reused[-1], (scenario, reused)
    ref_losses, ref_norms, ref_params = reference
    if scenario.startswith("bf16grad"):  # bf16 main grads: rounded, so loosely
        assert_losses_close(losses, ref_losses, rtol=2e-2, where=f"{scenario} losses")
        assert_losses_close(norms, ref_norms, rtol=2e-2, where=f"{scenario} norms")
    else:
        assert_losses_close(losses, ref_losses, where=f"{scenario} losses")
        assert_losses_close(norms, ref_norms, where=f"{scenario} norms")
        assert_tensors_close(params, ref_params, where=scenario)
    strategy = int(scenario[-1])
    # ZeRO-2/3: a storage to watch after every step but the one after zero_grad() with
    # no backward since (nothing allocated then).
    assert [bool(gone) for _n, gone in stored] == [
        strategy >= 2 and (b or not SCHEDULE[i - 1][2]) for i, (b, _c, _n) in enumerate(SCHEDULE)
    ], (scenario, stored)
    for to_none, gone in stored:
        # Released exactly when set_to_none: nothing else may hold the storage.
        assert all(gone) if to_none else not any(gone), (scenario, stored)


def _world2(scenarios):
    return {s: _train(s, 2) for s in scenarios}


def test_released_gradients_parity_and_memory():
    scenarios = ("zero2", "zero3", "bf16grad_zero3")
    (results, _) = run_distributed(_world2, 2, args=(scenarios,))
    reference = _reference(2)
    for s in scenarios:
        _check(results[s], reference, s)


def _world4(scenarios):
    return {s: _train(s, 4) for s in scenarios}


def test_released_gradients_hybrid():
    scenarios = ("hsdp_zero3", "full_zero3")
    (results, *_) = run_distributed(_world4, 4, args=(scenarios,))
    reference = _reference(4)
    for s in scenarios:
        _check(results[s], reference, s)


def _wrapped(strategy):
    """The test GPT and its optimizer, wrapped under ``strategy``."""
    torch.manual_seed(0)
    module = GPT(CFG)
    return fully_shard(
        module,
        _optimizer(module.parameters()),
        fsdp_unit_modules=[Block],
        zero_dp_strategy=strategy,
    )


def _stepped(strategy):
    """The wrapped GPT after one backward and step."""
    model, opt = _wrapped(strategy)
    x, y = _batch(0, 2)
    F.cross_entropy(model(x[:M]).flatten(0, 1), y[:M].flatten()).backward()
    opt.step()
    return model, opt


def _module_zero_grad():
    """``model.zero_grad()`` alone, as torch's ``Module.zero_grad``: set_to_none drops
    every ``.grad`` and releases the sharded gradients; set_to_none=False keeps them,
    zeroed."""
    out = {}
    for strategy in (2, 3):
        for to_none in (True, False):
            model, _opt = _stepped(strategy)
            live = _live_storages(model)
            model.zero_grad(set_to_none=to_none)
            grads = [p.grad for p in model.parameters()]
            out[(strategy, to_none)] = (
                bool(live),
                [w.expired() for w in live],
                [None if g is None else bool(g.to_local().any()) for g in grads],
            )
    return out


def test_module_zero_grad_releases_like_torch():
    for out in run_distributed(_module_zero_grad, 2):
        for (strategy, to_none), (watched, gone, grads) in out.items():
            assert watched, (strategy, to_none)
            if to_none:
                assert all(gone) and all(g is None for g in grads), (strategy, gone, grads)
            else:
                assert not any(gone) and grads and not any(grads), (strategy, gone, grads)


def _replicated_kept():
    out = {}
    for strategy in (0, 1):
        model, opt = _stepped(strategy)
        live = [
            StorageWeakRef(g.main_grad_buffer.data.untyped_storage())
            for g in model.buffer.groups
            if g.main_grad_buffer is not None
        ]
        opt.zero_grad()
        out[strategy] = [w.expired() for w in live]
    return out


def test_replicated_gradients_keep_their_buffer():
    for out in run_distributed(_replicated_kept, 2):
        assert out == {0: [False] * len(out[0]), 1: [False] * len(out[1])}, out


def _stale_reference(strategy):
    rank = dist.get_rank()
    model, opt = _wrapped(strategy)
    params = list(model.parameters())

    def backward(step):
        x, y = _batch(step, 2)
        rows = slice(rank * M, (rank + 1) * M)
        F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten()).backward()

    backward(0)
    kept = [p.grad for p in params]  # DTensors over this rank's rows
    values = [g.to_local().clone() for g in kept]
    storage = [g.to_local().untyped_storage() for g in kept]  # a holder of the old memory
    raw = [
        torch.empty(0, dtype=v.dtype).set_(
            s, g.to_local().storage_offset(), v.shape, g.to_local().stride()
        )
        for g, v, s in zip(kept, values, storage, strict=True)
    ]
    assert any(v.any() for v in values)
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    for g, r, v in zip(kept, raw, values, strict=True):
        assert isinstance(g, DTensor)
        assert not g.to_local().any()  # zeros, as the model's gradients are now
        assert g.full_tensor().shape == g.shape and not g.full_tensor().any()
        torch.testing.assert_close(r, v)  # the old memory is intact, not freed under it
    backward(1)
    for p, g in zip(params, kept, strict=True):
        assert p.grad is g  # the same object, following the new storage
        assert torch.isfinite(g.to_local()).all()
    new = [p.grad.to_local().clone() for p in params]
    assert any(not torch.equal(a, b) for a, b in zip(new, values, strict=True))
    for r, v in zip(raw, values, strict=True):
        torch.testing.assert_close(r, v)
    opt.step()
    return True


@pytest.mark.parametrize("strategy", [2, 3])
def test_stale_grad_reference_stays_valid(strategy):
    assert run_distributed(_stale_reference, 2, args=(strategy,)) == [True, True]
