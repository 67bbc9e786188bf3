"""Sharded state dicts and checkpoints of fsdp models, on 2 ranks: every strategy,
fp32 and bf16 compute, name-keyed optimizer state, in-place loading into the
buffers, full-state export, and interoperability with PyTorch FSDP2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.nn import functional as F

from fsdp_ckpt import (
    consolidate_checkpoint,
    get_full_model_state_dict,
    get_model_state_dict,
    get_optimizer_state_dict,
    load_checkpoint,
    load_full_state_dict,
    save_checkpoint,
    save_full_model_state_dict,
)
from fsdp_ckpt.row_shards import RowShards, strip_row_offsets
from fsdp_hooks import fully_shard
from fsdp_mesh.testing import harness_device, run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

# Runs on CUDA + NCCL under --fsdp-device cuda (root conftest.py).
pytestmark = pytest.mark.cuda

CFG = GPTConfig()
BATCH = 2  # per rank


def _module(seed: int, dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG).to(dtype)


def _ours(seed: int, strategy: int, dtype: torch.dtype = torch.float32):
    module = _module(seed, dtype)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
    return fully_shard(module, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)


def _fsdp2(seed: int):
    module = _module(seed)
    mesh = init_device_mesh(harness_device().type, (dist.get_world_size(),))
    for block in module.blocks:
        fsdp2_fully_shard(block, mesh=mesh)
    fsdp2_fully_shard(module, mesh=mesh)
    return module, torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model, opt, step: int) -> torch.Tensor:
    rank = dist.get_rank()
    x, y = token_batch(step, BATCH * dist.get_world_size(), CFG.max_seq_len, CFG.vocab_size)
    x, y = x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH]
    loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def _locals(model) -> dict[str, torch.Tensor]:
    return {k: v.to_local() for k, v in model.state_dict().items()}


def _optim_locals(model, opt) -> dict[str, torch.Tensor]:
    osd = strip_row_offsets(get_optimizer_state_dict(model, opt))
    return {
        f"{fqn}.{k}": v.to_local() if isinstance(v, DTensor) else v
        for fqn, state in osd["state"].items()
        for k, v in state.items()
    }


def _check_strategy(root: Path, strategy: int, dtype: torch.dtype) -> None:
    path = root / f"s{strategy}_{str(dtype)[6:]}"
    model, opt = _ours(0, strategy, dtype)
    _step(model, opt, 0)

    # Names, not positions; no wrapper prefix; live views with true offsets.
    plain = _module(0)
    names = [n for n, _ in plain.named_parameters()]
    sd = get_model_state_dict(model)
    assert list(sd) == list(plain.state_dict()), list(sd)
    params = dict(model.module.named_parameters(remove_duplicate=False))
    for key, value in sd.items():
        assert isinstance(value, DTensor), key
        sharded = value.placements[0] == Shard(0)
        # One rank shards nothing: its whole-tensor "shard" is a replica.
        assert sharded == (strategy > 0 and dist.get_world_size() > 1), (key, value.placements)
        if sharded:
            assert isinstance(value._local_tensor, RowShards), key
            shard = value._local_tensor.local_shards()[0]
            local = params[key]._local_tensor
            assert shard.shape == local.shape, key
            if local.numel():
                assert shard.data_ptr() == local.data_ptr(), f"{key}: a copy, not a view"
    osd = get_optimizer_state_dict(model, opt)
    assert sorted(osd["state"]) == sorted(names)
    assert osd["param_groups"][0]["params"] == names
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(osd["state"]["tok.weight"])

    save_checkpoint(path, model, opt, extra={"step": 1, "tag": strategy})
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    assert saved["model.tok.weight"].properties.dtype == torch.float32  # main weights
    assert saved["optim.state.blocks.0.mlp.0.weight.exp_avg"].size == (4 * CFG.dim, CFG.dim)

    # DCP alone loads in place into the buffers (the wrapper's shard IS the view).
    other, _ = _ours(1, strategy, dtype)
    target = get_model_state_dict(other)
    dcp.load({"model": target}, checkpoint_id=str(path))
    for key, value in _locals(other).items():
        assert torch.equal(value, _locals(model)[key]), f"{key} did not land in the buffer"

    # The full load: model (main and compute weights), optimizer, extra.
    loaded, loaded_opt = _ours(2, strategy, dtype)
    assert load_checkpoint(path, loaded, loaded_opt) == {"step": 1, "tag": strategy}
    for key, value in _locals(loaded).items():
        assert torch.equal(value, _locals(model)[key]), key
    mine, theirs = _optim_locals(loaded, loaded_opt), _optim_locals(model, opt)
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key
    x, _ = token_batch(5, BATCH, CFG.max_seq_len, CFG.vocab_size)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x)), "compute weights were not refreshed"
    # Training goes on identically.
    assert torch.equal(_step(loaded, loaded_opt, 1), _step(model, opt, 1))
    for key, value in _locals(loaded).items():
        assert torch.equal(value, _locals(model)[key]), key

    if strategy == 3 and dtype == torch.float32:
        full = get_full_model_state_dict(model, rank0_only=False)  # on the CPU
        for name, *_ in model.buffer.named_params():
            assert torch.equal(full[name], model.buffer.views.full_parameter(name).cpu()), name
        assert full["head.weight"] is full["tok.weight"]  # tied: gathered once
        save_full_model_state_dict(model, root / "full.safetensors")
        save_full_model_state_dict(model, root / "full.pt")
        save_checkpoint(root / "final", model, opt)


def _all_strategies(root: str) -> None:
    for strategy in (0, 1, 2, 3):
        _check_strategy(Path(root), strategy, torch.float32)
    for strategy in (1, 3):
        _check_strategy(Path(root), strategy, torch.bfloat16)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_strategy_and_bf16_round_trip(tmp_path, world_size):
    run_distributed(_all_strategies, world_size, args=(str(tmp_path),), timeout=240)
    # Three ways to one file agree, and each loads into the plain module.
    reference = _module(7)
    load_checkpoint(tmp_path / "final", reference)
    consolidate_checkpoint(tmp_path / "final", tmp_path / "offline.safetensors")
    for name in ("full.safetensors", "full.pt", "offline.safetensors"):
        module = _module(8)
        module.load_state_dict(load_full_state_dict(tmp_path / name))
        for key, value in module.state_dict().items():
            assert torch.equal(value, reference.state_dict()[key]), (name, key)


def _full(model) -> dict[str, torch.Tensor]:
    return get_full_model_state_dict(model, rank0_only=False)


def _interop(root: str) -> None:
    root_path = Path(root)
    theirs, theirs_opt = _fsdp2(0)
    _step(theirs, theirs_opt, 0)
    save_checkpoint(root_path / "fsdp2", theirs, theirs_opt, extra={"from": "fsdp2"})

    ours, ours_opt = _ours(1, 3)
    assert load_checkpoint(root_path / "fsdp2", ours, ours_opt) == {"from": "fsdp2"}
    expected = _full(theirs)
    for key, value in _full(ours).items():
        assert torch.equal(value, expected[key]), key
    a, b = _step(ours, ours_opt, 1), _step(theirs, theirs_opt, 1)
    assert abs(a - b) <= 1e-6 * abs(b), (a, b)

    save_checkpoint(root_path / "ours", ours, ours_opt, extra={"from": "ours"})
    back, back_opt = _fsdp2(2)
    assert load_checkpoint(root_path / "ours", back, back_opt) == {"from": "ours"}
    expected = _full(ours)
    for key, value in _full(back).items():
        assert torch.equal(value, expected[key]), key
    a, b = _step(back, back_opt, 2), _step(ours, ours_opt, 2)
    assert abs(a - b) <= 1e-6 * abs(b), (a, b)


# Another library's uneven row shards: Shard(0) DTensors without a row partition whose
# local rows are not torch.chunk-sized (and one rank empty); rows per rank below.
_SPLITS = {"0.weight": (1, 2), "0.bias": (3, 0), "1.weight": (6, 1)}


def _foreign_module(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Embedding(7, 4))


def _foreign_uneven(seed: int) -> torch.nn.Sequential:
    module = _foreign_module(seed)
    mesh = init_device_mesh(harness_device().type, (dist.get_world_size(),))
    rank = dist.get_rank()
    for name, rows in _SPLITS.items():
        sub, attr = name.split(".")
        full = getattr(module[int(sub)], attr).detach()
        start = sum(rows[:rank])
        local = full[start : start + rows[rank]].clone()
        dt = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
        setattr(module[int(sub)], attr, torch.nn.Parameter(dt))
    return module


def _uneven_foreign_shards(root: Path) -> None:
    saved = _foreign_uneven(0)
    sd = get_model_state_dict(saved)  # offsets found by one gather of row counts
    assert all(isinstance(v._local_tensor, RowShards) for v in sd.values())
    save_checkpoint(root / "foreign", saved)
    loaded = _foreign_uneven(1)
    load_checkpoint(root / "foreign", loaded)
    for key, value in _locals(loaded).items():
        assert torch.equal(value, _locals(saved)[key]), key
    expected = _foreign_module(0).state_dict()
    for key, value in get_full_model_state_dict(saved, rank0_only=False).items():
        assert torch.equal(value, expected[key]), key


def _rank_value(seed: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 2, generator=torch.Generator().manual_seed(seed * 10 + rank)).to(
        harness_device()
    )


def _with_rank_keys(seed: int) -> torch.nn.Sequential:
    """``_foreign_uneven`` plus a parameter only this rank has, under its own key (as
    each expert-parallel rank has its experts): a DTensor on this rank's own mesh,
    without a row partition."""
    module = _foreign_uneven(seed)
    rank = dist.get_rank()
    own = init_device_mesh(
        harness_device().type, (1, dist.get_world_size()), mesh_dim_names=("own", "all")
    )
    holder = torch.nn.Module()
    dt = DTensor.from_local(_rank_value(seed, rank), own["own"], [Shard(0)], run_check=False)
    holder.register_parameter(f"w{rank}", torch.nn.Parameter(dt))
    module.append(holder)
    return module


def _keys_differ_across_ranks(root: Path) -> None:
    saved = _with_rank_keys(0)
    save_checkpoint(root / "rank_keys", saved)
    loaded = _with_rank_keys(1)
    load_checkpoint(root / "rank_keys", loaded)  # strict: another rank's key is no surprise
    for key, value in _locals(loaded).items():
        assert torch.equal(value, _locals(saved)[key]), key
    expected = dict(_foreign_module(0).state_dict())
    # The full state dict is on the CPU; _rank_value on the rank's device.
    expected.update({f"2.w{r}": _rank_value(0, r).cpu() for r in range(dist.get_world_size())})
    for rank0_only in (True, False):
        full = get_full_model_state_dict(saved, rank0_only=rank0_only)
        if rank0_only and dist.get_rank() != 0:
            assert full == {}
            continue
        assert set(full) == set(expected)
        for key, value in full.items():
            assert torch.equal(value, expected[key]), key


def _interop_and_foreign(root: str) -> None:
    _interop(root)
    _uneven_foreign_shards(Path(root))
    _keys_differ_across_ranks(Path(root))


def test_fsdp2_interop_and_foreign_uneven_shards(tmp_path):
    run_distributed(_interop_and_foreign, 2, args=(str(tmp_path),), timeout=180)
    plain = _foreign_module(9)
    load_checkpoint(tmp_path / "foreign", plain)
    expected = _foreign_module(0).state_dict()
    for key, value in plain.state_dict().items():
        assert torch.equal(value, expected[key]), key
    consolidate_checkpoint(tmp_path / "rank_keys", tmp_path / "rank_keys.pt")
    full = load_full_state_dict(tmp_path / "rank_keys.pt")
    assert {k for k in full if k.startswith("2.")} == {"2.w0", "2.w1"}
    assert torch.equal(full["2.w1"], _rank_value(0, 1))
