"""Checkpoints cross between PyTorch FSDP2 users' own code and ours, both ways.

FSDP2 side: what its users write, with no fsdp import: ``dcp.save``/``dcp.load`` of
``torch.distributed.checkpoint.state_dict.get_state_dict`` and ``set_state_dict``.
Our side: ``fsdp_hooks.fully_shard`` and ``fsdp_ckpt.load_checkpoint`` /
``save_checkpoint``. After each crossing the parameters are equal and training goes
on as it would have (so the optimizer state came across too). Then the
``fsdp-consolidate`` command, run as a real process, turns the 2-rank checkpoint into
one file for the plain module."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.nn import functional as F

from fsdp_ckpt import (
    ForeignCheckpointWarning,
    get_full_model_state_dict,
    load_checkpoint,
    load_full_state_dict,
    save_checkpoint,
)
from fsdp_hooks import fully_shard
from fsdp_mesh.testing import harness_device, run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

# Runs on CUDA + NCCL under --fsdp-device cuda (root conftest.py).
pytestmark = pytest.mark.cuda

CFG = GPTConfig()
GLOBAL_BATCH = 4


def _module(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def _fsdp2(seed: int) -> tuple[GPT, torch.optim.Optimizer]:
    module = _module(seed)
    mesh = init_device_mesh(harness_device().type, (dist.get_world_size(),))
    for block in module.blocks:
        fsdp2_fully_shard(block, mesh=mesh)
    fsdp2_fully_shard(module, mesh=mesh)
    return module, torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)


def _ours(seed: int):
    module = _module(seed)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
    return fully_shard(module, opt, fsdp_unit_modules=[Block], zero_dp_strategy=3)


def _step(model, opt, step: int) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    b = GLOBAL_BATCH // world
    x, y = token_batch(step, GLOBAL_BATCH, CFG.max_seq_len, CFG.vocab_size)
    loss = F.cross_entropy(
        model(x[rank * b : (rank + 1) * b]).flatten(0, 1), y[rank * b : (rank + 1) * b].flatten()
    )
    loss.backward()
    opt.step()
    opt.zero_grad()
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / world


def _fsdp2_full(model: GPT) -> dict[str, torch.Tensor]:
    # FSDP2's DTensors are torch.chunk-sized, so DTensor's own gather is exact. On the
    # CPU, as get_full_model_state_dict's are.
    return {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}


def _ours_full(model) -> dict[str, torch.Tensor]:
    return get_full_model_state_dict(model, rank0_only=False)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _assert_same_loss(a: float, b: float) -> None:
    assert abs(a - b) <= 1e-6 * abs(b), (a, b)


def _fsdp2_save(model, opt, path: Path, torchtitan: bool) -> None:
    """Two ways FSDP2 users lay out a checkpoint: DCP's tutorial's (model and
    optimizer under top-level keys) and torchtitan's (the model at the top level, the
    optimizer flattened, the training step beside them)."""
    if torchtitan:
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        msd, osd = get_state_dict(model, opt, options=options)
        dcp.save({**msd, "optimizer": osd, "train_state": {"step": 1}}, checkpoint_id=path)
    else:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=path)


def _fsdp2_load(model, opt, path: Path) -> None:
    """What an FSDP2 user writes to load our checkpoint (layout in docs/guide/checkpoints.md)."""
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _both_ways(root: str, torchtitan: bool) -> dict[str, torch.Tensor]:
    root_path = Path(root)
    # (a) FSDP2 trains a step and saves with plain DCP; ours loads it.
    theirs, theirs_opt = _fsdp2(0)
    _step(theirs, theirs_opt, 0)
    _fsdp2_save(theirs, theirs_opt, root_path / "fsdp2", torchtitan)
    ours, ours_opt = _ours(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_checkpoint(root_path / "fsdp2", ours, ours_opt) == {}
    foreign = [w for w in caught if issubclass(w.category, ForeignCheckpointWarning)]
    # Said once, by rank 0, not once per rank.
    assert len(foreign) == (dist.get_rank() == 0), [str(w.message) for w in caught]
    assert all("no fsdp_manifest.json" in str(w.message) for w in foreign)
    _assert_same(_ours_full(ours), _fsdp2_full(theirs))
    # Two steps: the second one's loss depends on the loaded Adam moments. (Parameters
    # are not compared after stepping: the key part of qkv.bias has no gradient but
    # rounding noise, which Adam scales up to +-lr differently in each library.)
    for step in (1, 2):
        _assert_same_loss(_step(ours, ours_opt, step), _step(theirs, theirs_opt, step))

    # (b) Ours saves; a fresh FSDP2 model loads it with plain DCP and set_state_dict.
    save_checkpoint(root_path / "ours", ours, ours_opt)
    back, back_opt = _fsdp2(2)
    _fsdp2_load(back, back_opt, root_path / "ours")
    _assert_same(_fsdp2_full(back), _ours_full(ours))
    for step in (3, 4):
        _assert_same_loss(_step(back, back_opt, step), _step(ours, ours_opt, step))
    save_checkpoint(root_path / "ours", ours)  # for the command-line tool below
    return _ours_full(ours)


def _consolidate_with_the_command(checkpoint: Path, expected: dict[str, torch.Tensor]) -> None:
    """``fsdp-consolidate``, the installed console script, in a process of its own."""
    out = checkpoint.parent / "full.safetensors"
    script = Path(sys.executable).parent / "fsdp-consolidate"
    done = subprocess.run(
        [str(script), str(checkpoint), str(out)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert f"to {out}" in done.stdout, done.stdout
    plain = _module(3)
    plain.load_state_dict(load_full_state_dict(out))
    _assert_same(plain.state_dict(), expected)


@pytest.mark.parametrize(("world", "torchtitan"), [(2, False), (4, True)])
def test_fsdp2_plain_dcp_checkpoints_both_ways(tmp_path, world, torchtitan):
    expected = run_distributed(_both_ways, world, args=(str(tmp_path), torchtitan), timeout=120)[0]
    if world == 2:  # one sharded checkpoint written by 2 ranks is enough for the tool
        _consolidate_with_the_command(tmp_path / "ours", expected)


def _plain_both_ways(root: str) -> None:
    """No fsdp checkpoint function on either side: ``get_state_dict`` + ``dcp.save``,
    ``dcp.load`` + ``set_state_dict``, FSDP2 -> ours and ours -> FSDP2. Values equal,
    then the next steps' losses (which read the loaded Adam moments) equal."""
    root_path = Path(root)
    theirs, theirs_opt = _fsdp2(0)
    _step(theirs, theirs_opt, 0)
    _fsdp2_save(theirs, theirs_opt, root_path / "plain_fsdp2", torchtitan=False)
    ours, ours_opt = _ours(1)
    msd, osd = get_state_dict(ours, ours_opt)
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=root_path / "plain_fsdp2")
    set_state_dict(
        ours, ours_opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    _assert_same(_fsdp2_full(ours), _fsdp2_full(theirs))
    _assert_same_loss(_step(ours, ours_opt, 1), _step(theirs, theirs_opt, 1))

    msd, osd = get_state_dict(ours, ours_opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=root_path / "plain_ours")
    back, back_opt = _fsdp2(2)
    msd, osd = get_state_dict(back, back_opt)
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=root_path / "plain_ours")
    set_state_dict(
        back, back_opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    _assert_same(_fsdp2_full(back), _fsdp2_full(ours))
    _assert_same_loss(_step(back, back_opt, 2), _step(ours, ours_opt, 2))


def test_plain_dcp_between_fsdp2_and_ours_both_ways(tmp_path):
    run_distributed(_plain_both_ways, 2, args=(str(tmp_path),))
