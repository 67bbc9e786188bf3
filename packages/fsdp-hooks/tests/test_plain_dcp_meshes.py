"""Plain ``dcp.save``/``dcp.load`` of ``model.state_dict()`` and ``optimizer.state_dict()``
restores every value on the other meshes too: HSDP (outer replicate and fully-sharded),
an expert-parallel mesh and a tensor-parallel mesh (torch's ``parallelize_module`` and
Megatron-Core style), also with HSDP, at 4 ranks. Their DTensors keep DTensor's contract (issue
"torch-native state"), so no fsdp checkpoint function is needed. The models are those of
``test_hybrid.py``, ``test_expert.py`` and ``test_tensor_parallel.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from fsdp_mesh.testing import load_sibling, run_distributed


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": _full(v).clone() for k, v in model.state_dict().items()}
    for pid, state in (opt.state_dict()["state"] if opt is not None else {}).items():
        for key, value in state.items():
            out[f"optim.{pid}.{key}"] = _full(value).clone()
    return out


def _round_trip(model, opt, path: str) -> None:
    saved = _snapshot(model, opt)
    if opt is None:  # model state only
        saved = {k: v for k, v in saved.items() if k.startswith("model.")}
        opt_state = {}
    else:
        assert any(k.startswith("optim.") for k in saved), "the optimizer has state"
        opt_state = {"optim": opt.state_dict()}
    dcp.save({"model": model.state_dict(), **opt_state}, checkpoint_id=path)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
        for state in opt.state.values() if opt is not None else ():
            for value in state.values():
                if torch.is_tensor(value) and value.is_floating_point():
                    value.fill_(3.0)
    state = {"model": model.state_dict(), **({"optim": opt.state_dict()} if opt else {})}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    if opt is not None:
        opt.load_state_dict(state["optim"])
    got = {k: v for k, v in _snapshot(model, opt).items() if k in saved}
    assert set(got) == set(saved)
    for key, value in saved.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


def _step(model, opt, loss_fn) -> None:
    loss_fn(model).backward()
    opt.step()
    opt.zero_grad()


def _hybrid(path: str, scenario: str) -> None:
    hybrid = load_sibling(__file__, "test_hybrid.py")
    model, opt, _kind, _sync = hybrid._build(scenario)
    x, y = hybrid._global_batch(0)
    b = x.shape[0] // dist.get_world_size()
    r = dist.get_rank()
    _step(
        model,
        opt,
        lambda m: torch.nn.functional.cross_entropy(
            m(x[r * b : (r + 1) * b]).flatten(0, 1), y[r * b : (r + 1) * b].flatten()
        ),
    )
    _round_trip(model, opt, path)


def _expert(path: str, strategy: int) -> None:
    ckpt = load_sibling(__file__, "test_expert_checkpoint.py")
    toy = ckpt.toy
    model, opt, _ids = ckpt._model(toy.EP, strategy, 0)
    ckpt._steps(model, opt, 0, 1)
    # Model state only: ``optimizer.state_dict()`` numbers parameters by position, and
    # position k is a different expert on each expert-parallel rank, so its entries
    # collide in plain DCP (fsdp.save_checkpoint keys them by global name instead).
    _round_trip(model, None, path)


def _expert_optimizer_refused(path: str) -> str:
    ckpt = load_sibling(__file__, "test_expert_checkpoint.py")
    model, opt, _ids = ckpt._model(ckpt.toy.EP, 3, 0)
    ckpt._steps(model, opt, 0, 1)
    # torch.save-style use still sees ordinary DTensors...
    state = opt.state_dict()
    assert all(isinstance(v, DTensor) for s in state["state"].values() for v in s.values())
    # ...but plain DCP refuses the positional expert entries on every rank (DCP wraps
    # our ValueError in its CheckpointException).
    with pytest.raises(CheckpointException) as info:
        dcp.save({"optim": opt.state_dict()}, checkpoint_id=path)
    # fsdp's own checkpoint keys them by global name and works.
    from fsdp_ckpt import load_checkpoint, save_checkpoint

    save_checkpoint(f"{path}_fsdp", model, opt)
    load_checkpoint(f"{path}_fsdp", model, opt)
    return str(info.value)


def _tensor_parallel(path: str, kind: str, strategy: int) -> None:
    tp = load_sibling(__file__, "test_tensor_parallel.py")
    model, opt = tp._wrap(kind, strategy)
    tp._train(model, opt, 0, 1)
    _round_trip(model, opt, path)


def _tp_hybrid(path: str, kind: str, outer: str) -> None:
    combos = load_sibling(__file__, "test_mesh_combinations.py")
    model, opt = combos.wrap_tp_hybrid(kind, outer)
    combos.train_tp(model, opt, 0, 1)
    _round_trip(model, opt, path)


def _meta_fully_sharded(path: str) -> None:
    combos = load_sibling(__file__, "test_mesh_combinations.py")
    model, opt = combos.wrap_hybrid(meta=True, outer="optim")
    combos.train_hybrid(model, opt, 0, 1)
    _round_trip(model, opt, path)


@pytest.mark.parametrize("scenario", ["hsdp_z1_sync_each", "hsdp_sync_each", "full_sync_each"])
def test_hsdp_round_trip(tmp_path, scenario):
    run_distributed(_hybrid, 4, args=(str(tmp_path / "ckpt"), scenario))


@pytest.mark.parametrize("strategy", [1, 3])
def test_expert_mesh_round_trip(tmp_path, strategy):
    run_distributed(_expert, 4, args=(str(tmp_path / "ckpt"), strategy))


@pytest.mark.parametrize("kind, strategy", [("dtensor", 3), ("dtensor", 1), ("megatron", 2)])
def test_tensor_parallel_round_trip(tmp_path, kind, strategy):
    run_distributed(_tensor_parallel, 4, args=(str(tmp_path / "ckpt"), kind, strategy))


@pytest.mark.parametrize(
    "kind, outer, world", [("dtensor", "no_shard", 4), ("megatron", "optim", 8)]
)
def test_tensor_parallel_hybrid_round_trip(tmp_path, kind, outer, world):
    """Tensor parallelism with HSDP (outer replicate) on (dp_outer 2, dp_shard 1, tp 2)
    and fully-sharded HSDP on (dp_outer 2, dp_shard 2, tp 2)."""
    run_distributed(_tp_hybrid, world, args=(str(tmp_path / "ckpt"), kind, outer), timeout=240)


def test_meta_init_fully_sharded_hsdp_round_trip(tmp_path):
    """A model materialized from the meta device under fully-sharded HSDP (2 x 2)."""
    run_distributed(_meta_fully_sharded, 4, args=(str(tmp_path / "ckpt"),))


def _meta_tensor_parallel(path: str) -> None:
    combos = load_sibling(__file__, "test_mesh_combinations.py")
    model, opt = combos.wrap_tp_meta(meta=True, outer=None)
    combos.train_tp(model, opt, 0, 1)
    _round_trip(model, opt, path)


def test_meta_init_tensor_parallel_round_trip(tmp_path):
    """A ``parallelize_module`` model materialized from the meta device, (dp_shard, tp)."""
    run_distributed(_meta_tensor_parallel, 4, args=(str(tmp_path / "ckpt"),))


def _expert_hybrid(path: str, outer: str) -> None:
    combos = load_sibling(__file__, "test_mesh_combinations.py")
    model, opt, _ids = combos.wrap_expert_hybrid(outer)
    combos.train_expert(model, opt, 0, 1)
    _round_trip(model, None, path)  # model state only, as for _expert


@pytest.mark.parametrize("outer, world", [("no_shard", 4), ("optim", 8)])
def test_expert_mesh_hybrid_round_trip(tmp_path, outer, world):
    """Expert parallelism with HSDP (2 x 2, ep 2) and fully-sharded HSDP (2 x 4, ep 2)."""
    run_distributed(_expert_hybrid, world, args=(str(tmp_path / "ckpt"), outer), timeout=240)


def test_expert_optimizer_state_refuses_plain_dcp(tmp_path):
    """Position k of ``optimizer.state_dict()`` is a different expert on each
    expert-parallel rank: plain DCP would mix them, so it raises (on every rank)."""
    for message in run_distributed(_expert_optimizer_refused, 4, args=(str(tmp_path / "c"),)):
        assert "different expert on each expert-parallel rank" in message
        assert "fsdp.save_checkpoint" in message
