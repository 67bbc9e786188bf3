"""Plain DCP checkpoints (no fsdp manifest) in the layouts FSDP2 users write with
torch's ``get_state_dict``: found from their keys, loaded with one warning, checked for
truncation, and mismatches named. One process, no process group."""

from __future__ import annotations

import itertools
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from fsdp_ckpt import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    ForeignCheckpointWarning,
    IncompleteCheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from fsdp_ckpt.atomic import incomplete_dir
from fsdp_ckpt.extra import EXTRA_DIR
from fsdp_ckpt.manifest import MANIFEST_NAME

# Expected where loads are made; ``_load`` checks it is given exactly once.
pytestmark = pytest.mark.filterwarnings("ignore::fsdp_ckpt.ForeignCheckpointWarning")


def _mlp(seed: int, *dims: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(dims)))


def _trained(seed: int = 0) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    model = _mlp(seed, 4, 3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


class _App(Stateful):
    """DCP's tutorial: the model and optimizer behind one Stateful."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError("only saved here")


def _nested(key: str) -> Callable[[nn.Module, torch.optim.Optimizer], dict[str, Any]]:
    def build(model, opt):
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, key: osd}

    return build


def _torchtitan(model, opt) -> dict[str, Any]:
    msd, osd = get_state_dict(
        model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    return {**msd, "optimizer": osd, "train_state": {"step": 1}}


LAYOUTS = {
    "model+optim": _nested("optim"),
    "model+optimizer": _nested("optimizer"),
    "stateful app": lambda model, opt: {"app": _App(model, opt)},
    "torchtitan flat": _torchtitan,
    "flat, no optimizer": lambda model, opt: dict(model.state_dict()),
}


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=path)


def _load(path: Path, model: nn.Module, opt=None, **kwargs) -> dict[str, Any]:
    """``load_checkpoint``, checking it warned exactly once that there is no manifest."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = load_checkpoint(path, model, opt, **kwargs)
    foreign = [w for w in caught if issubclass(w.category, ForeignCheckpointWarning)]
    assert len(foreign) == 1, [str(w.message) for w in caught]
    assert "cannot be verified" in str(foreign[0].message)
    return extra


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_of_torch_get_state_dict_load(tmp_path, layout):
    saved, saved_opt = _trained()
    _dcp_save(LAYOUTS[layout](saved, saved_opt), tmp_path / "c")
    model = _mlp(1, 4, 3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)  # never stepped; lr from the file
    with_optim = layout != "flat, no optimizer"
    assert _load(tmp_path / "c", model, opt if with_optim else None) == {}
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved.state_dict()[key]), key
    if not with_optim:
        with pytest.raises(CheckpointMismatchError, match="holds no optimizer state"):
            load_checkpoint(tmp_path / "c", model, opt)
        return
    assert opt.param_groups[0]["lr"] == 0.1
    for p, q in zip(model.parameters(), saved.parameters(), strict=True):
        assert opt.state[p].keys() == saved_opt.state[q].keys()
        for name, value in saved_opt.state[q].items():
            assert torch.equal(opt.state[p][name], value), name


def test_truncated_or_missing_files_are_refused(tmp_path):
    path = tmp_path / "c"
    _dcp_save(_nested("optim")(*_trained()), path)
    shard = next(path.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[:-1])
    with pytest.raises(CorruptCheckpointError, match=rf"{shard.name}: {len(data) - 1} bytes"):
        load_checkpoint(path, _mlp(1, 4, 3, 2))
    shard.unlink()
    with pytest.raises(CorruptCheckpointError, match=rf"{shard.name}: missing"):
        load_checkpoint(path, _mlp(1, 4, 3, 2))


def test_mismatches_name_the_keys(tmp_path):
    saved, saved_opt = _trained()
    _dcp_save(_nested("optim")(saved, saved_opt), tmp_path / "nested")
    _dcp_save(dict(saved.state_dict()), tmp_path / "flat")
    with pytest.raises(CheckpointMismatchError, match=r"missing from the checkpoint: model\.2\."):
        load_checkpoint(tmp_path / "nested", _mlp(1, 4, 3, 2, 2))
    with pytest.raises(
        CheckpointMismatchError, match=r"not here: model\.1\.bias, model\.1\.weight"
    ):
        load_checkpoint(tmp_path / "nested", _mlp(1, 4, 3))
    with pytest.raises(CheckpointMismatchError, match=r"not here: 1\.bias, 1\.weight"):
        load_checkpoint(tmp_path / "flat", _mlp(1, 4, 3))
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(tmp_path / "flat", _mlp(1, 4, 5, 2))
    assert "0.weight (checkpoint (3, 4), here (5, 4))" in str(info.value)
    model = _mlp(1, 4, 3)
    _load(tmp_path / "flat", model, strict=False)  # leaves out the checkpoint's 1.*
    assert torch.equal(model[0].weight, saved[0].weight)

    sgd_model = _mlp(1, 4, 3, 2)
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointMismatchError, match=r"optim\.state\.0\.weight\.momentum_buffer"):
        load_checkpoint(tmp_path / "nested", sgd_model, sgd)
    with pytest.raises(CheckpointMismatchError, match="none of the model's 2 state dict keys"):
        load_checkpoint(tmp_path / "flat", nn.ModuleDict({"enc": nn.Linear(4, 3)}))


def test_our_interrupted_saves_stay_refused(tmp_path):
    """Ours without its manifest is an interrupted save, not a foreign checkpoint,
    even where DCP's .metadata was written."""
    path = tmp_path / "ckpt"
    save_checkpoint(path, _mlp(0, 4, 3))
    (path / MANIFEST_NAME).unlink()
    with pytest.raises(IncompleteCheckpointError, match="interrupted save"):
        load_checkpoint(path, _mlp(1, 4, 3))
    shutil.rmtree(path / EXTRA_DIR)
    path.rename(incomplete_dir(path))
    with pytest.raises(IncompleteCheckpointError, match="interrupted save"):
        load_checkpoint(incomplete_dir(path), _mlp(1, 4, 3))
