"""A wrap that raises leaves the module as it was (``fsdp_hooks.rollback``): its own
parameter objects, plain tensors with their values, no fsdp hooks or attributes, and it
wraps again. Two failures are forced on both ranks of world size 2, under every
strategy: inside ``ParamAndGradBuffer`` after the first group's storage moved into its
buffers, and at the very end of the wrap (hooks registered, parameters swapped for
DTensors). Under ZeRO-3 a moved group's values exist on a rank only as its shard: those
parameters go to the meta device and the error names them (printing them is safe; it
used to read freed memory)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_hooks.megatron_fsdp as megatron_fsdp
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


def _fail_in_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    original = Bucket.point_params_at_buffers

    def point(self):
        if self.gid == 1:  # bucket 0's storage has moved into its buffers
            raise Boom("allocation failed")
        original(self)

    monkeypatch.setattr(Bucket, "point_params_at_buffers", point)


def _fail_at_end(monkeypatch: pytest.MonkeyPatch) -> None:
    def summary(wrapper):
        raise Boom("late failure")

    monkeypatch.setattr(megatron_fsdp, "log_unit_summary", summary)


def _attempt(strategy: int, fail) -> dict:
    module = _gpt()
    slots = {n: p for n, p in module.named_parameters()}
    before = {n: p.detach().clone() for n, p in slots.items()}
    x, _y = token_batch(0, 2, CFG.max_seq_len, CFG.vocab_size)
    with torch.no_grad():
        expected_out = module(x)
    with pytest.MonkeyPatch.context() as mp:
        fail(mp)
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        with pytest.raises(Boom) as info:
            fully_shard(module, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
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


def _all() -> dict:
    return {
        (where, s): _attempt(s, fail)
        for where, fail in (("buffer", _fail_in_buffer), ("end", _fail_at_end))
        for s in (0, 1, 2, 3)
    }


def test_a_failed_wrap_leaves_the_module_as_it_was():
    got = run_distributed(_all, 2, timeout=120)
    assert got[0] == got[1]
    for (where, strategy), result in got[0].items():
        if strategy < 3:
            assert result["lost"] == [], (where, strategy)
        else:  # the groups moved before the failure, sharded
            assert result["lost"], (where, strategy)
    assert set(got[0][("buffer", 3)]["lost"]) < set(got[0][("end", 3)]["lost"])
    assert dist.is_available()
