"""A wrap that raises leaves the module as it was (``fsdp_hooks.setup.rollback``): its own
parameter objects, plain tensors with their values, no fsdp hooks or attributes, and it
wraps again. Two failures are forced at world size 2, under every strategy: inside
``ParamAndGradBuffer`` after the first group's storage moved into its buffers, and at
the very end of the wrap (hooks registered, parameters swapped for DTensors); on both
ranks, or on rank 1 only (the other rank then finishes its wrap, every group split).
Every rank raises (the failed one its own exception, the other a RuntimeError naming
rank 1 and the exception) and every rank's module has its original values back, ZeRO-3
included, whose moved groups exist on a rank only as shards (printing them used to read
freed memory; before the agreement they went to the meta device)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_hooks.module.megatron_fsdp as megatron_fsdp
from fsdp_buffers import Bucket
from fsdp_hooks import fully_shard
from fsdp_mesh.testing import run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

CFG = GPTConfig(vocab_size=32, max_seq_len=8, dim=16, n_heads=2, n_layers=2)


class Boom(RuntimeError):
    pass


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _fail_in_buffer(monkeypatch: pytest.MonkeyPatch, ranks: tuple[int, ...]) -> None:
    original = Bucket.point_params_at_buffers

    def point(self):
        if (
            self.gid == 1 and dist.get_rank() in ranks
        ):  # bucket 0's storage has moved into its buffers
            raise Boom("allocation failed")
        original(self)

    monkeypatch.setattr(Bucket, "point_params_at_buffers", point)


def _fail_at_end(monkeypatch: pytest.MonkeyPatch, ranks: tuple[int, ...]) -> None:
    original = megatron_fsdp.log_unit_summary

    def summary(wrapper):
        if dist.get_rank() in ranks:
            raise Boom("late failure")
        original(wrapper)

    monkeypatch.setattr(megatron_fsdp, "log_unit_summary", summary)


def _attempt(strategy: int, fail, ranks: tuple[int, ...], double_buffer: bool) -> dict:
    module = _gpt()
    slots = {n: p for n, p in module.named_parameters()}
    before = {n: p.detach().clone() for n, p in slots.items()}
    x, _y = token_batch(0, 2, CFG.max_seq_len, CFG.vocab_size)
    with torch.no_grad():
        expected_out = module(x)
    with pytest.MonkeyPatch.context() as mp:
        fail(mp, ranks)
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        failed_here = dist.get_rank() in ranks
        with pytest.raises(Boom if failed_here else RuntimeError) as info:
            fully_shard(
                module,
                opt,
                fsdp_unit_modules=[Block],
                zero_dp_strategy=strategy,
                fsdp_double_buffer=double_buffer,
            )
    after = dict(module.named_parameters())
    lost = sorted(n for n, p in after.items() if p.is_meta)
    # The same objects in their slots, but for lost ones (meta now; the old emptied).
    assert all(after[n] is slots[n] for n in slots if n not in lost)
    assert all(type(p) is nn.Parameter for p in after.values())
    for p in [*after.values(), *slots.values()]:
        repr(p)  # reads every value: used to read freed memory
        assert not [a for a in vars(p) if "fsdp" in a or a == "main_grad"]
    kept = {n: p for n, p in after.items() if not p.is_meta}
    assert all(torch.equal(p, before[n]) for n, p in kept.items())
    notes = "\n".join(getattr(info.value, "__notes__", []))
    message = notes if failed_here else str(info.value)
    assert "wrapping failed on" in message and "rank 1: Boom" in message, message
    if lost:
        assert "now on the meta device" in notes and f"{len(lost)} parameter(s)" in notes
        return {"lost": lost}
    with torch.no_grad():
        assert torch.equal(module(x), expected_out)  # no fsdp hook left on it
    # And it wraps again, and trains.
    model, opt = fully_shard(
        module, torch.optim.SGD(module.parameters(), lr=0.1), fsdp_unit_modules=[Block]
    )
    model(x).sum().backward()
    opt.step()
    return {"lost": lost}


CASES = [
    (where, ranks, s, False)
    for where in ("buffer", "end")
    for ranks in ((0, 1), (1,))
    for s in (0, 1, 2, 3)
] + [("buffer", (1,), 3, True), ("end", (1,), 3, True)]


def _all() -> dict:
    fails = {"buffer": _fail_in_buffer, "end": _fail_at_end}
    return {case: _attempt(case[2], fails[case[0]], case[1], case[3]) for case in CASES}


def test_a_failed_wrap_leaves_the_module_as_it_was():
    """Nothing is lost on any rank, ZeRO-3 (the originals kept until the ranks agree)
    included, whether one rank or both failed."""
    got = run_distributed(_all, 2, timeout=120)
    for rank in (0, 1):
        assert set(got[rank]) == set(CASES)
        for case, result in got[rank].items():
            assert result["lost"] == [], (rank, case)
