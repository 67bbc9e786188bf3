"""DTensors in ``save_checkpoint``'s ``extra`` (EMA weights taken from
``model.state_dict()``) are refused at save, on every rank, naming the entry and what
to do instead, before anything is written: ``extra`` is pickled per rank, so at
another world size every rank would get rank 0's pickled shard, still claiming the
saving job's mesh (``to_local()`` silently rank 0's rows)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fsdp_ckpt import CheckpointError, save_checkpoint
from fsdp_hooks import fully_shard
from fsdp_mesh.testing import run_distributed


def _save_ema_in_extra(root: str) -> dict[str, str]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    model, opt = fully_shard(
        module, torch.optim.AdamW(module.parameters()), fsdp_unit_modules=[nn.Linear]
    )
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    got = {}
    for name, extra in {
        "flat": {"step": 3, "ema": ema},
        "nested": {"step": 3, "averages": [{"decay": 0.99, "weights": ema}]},
    }.items():
        try:
            save_checkpoint(Path(root) / name, model, opt, extra=extra)
            got[name] = "saved"
        except CheckpointError as exc:
            got[name] = str(exc)
    # plain tensors and other values are still saved
    save_checkpoint(Path(root) / "plain", model, opt, extra={"t": torch.ones(2), "step": 3})
    return got


def test_dtensors_in_extra_are_refused_at_save(tmp_path):
    got = run_distributed(_save_ema_in_extra, 2, args=(str(tmp_path),), timeout=90)
    assert got[0] == got[1], got
    flat, nested = got[0]["flat"], got[0]["nested"]
    assert "extra['ema']['0.weight'] is a DTensor" in flat, flat
    assert "extra['averages'][0]['weights']['0.weight'] is a DTensor" in nested, nested
    for message in (flat, nested):
        assert "full_tensor()" in message and "dcp.save" in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]  # nothing else written
