"""The wrappers (``fully_shard``'s ``MegatronFSDP``, the FSDP and DDP adapters) resolve
the wrapped module's attributes as FSDP1's wrapper does: ``config``, methods bound to
the wrapped module, nested paths; their own attributes, parameters and submodules win;
a missing attribute is an AttributeError naming both; an uninitialised wrapper does not
recurse. ``named_parameters()`` gives ``state_dict()``'s names."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fsdp_hooks import (
    DistributedDataParallel,
    FullyShardedDataParallel,
    MegatronFSDP,
    fully_shard,
)
from fsdp_hooks.module.inner_module import InnerModuleAttributes
from fsdp_mesh.testing import run_distributed


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(dim=8)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(2))
        self.head = nn.Linear(8, 4, bias=False)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = torch.tanh(layer(x))
        return self.head(x) * self.scale

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x).argmax(-1)


def _check(wrapper: nn.Module, inner: Net, own_config: object) -> dict:
    torch.manual_seed(0)
    reference = Net()  # the wrapped model's initial weights, unwrapped
    x = torch.randn(3, 8)
    with pytest.raises(AttributeError) as missing:
        _ = wrapper.no_such_attribute
    owner = wrapper.generate.__self__
    return {
        "config": wrapper.config is own_config,
        # The inner model's method, or MegatronFSDP's own generate, which runs it with
        # every forward gathered as the wrapper's forward is (ZeRO-3 included).
        "generate_bound": owner is inner or type(owner).__name__ == "MegatronFSDP",
        "generate": torch.equal(wrapper.generate(x), reference.generate(x)),
        "layers": wrapper.model.layers is inner.model.layers,
        "layer_weight": wrapper.model.layers[0].weight is inner.model.layers[0].weight,
        "buffer": wrapper.scale is inner.scale,
        "missing": str(missing.value),
        "names": [n for n, _ in wrapper.named_parameters()],
        "buffers": [n for n, _ in wrapper.named_buffers()],
        "state_keys": list(wrapper.state_dict()),
    }


def _run() -> dict:
    out = {}
    torch.manual_seed(0)
    inner = Net()
    model, _ = fully_shard(
        inner, torch.optim.AdamW(inner.parameters()), fsdp_unit_modules=[nn.Linear]
    )
    out["fully_shard"] = _check(model, inner, inner.config)
    out["module_is_inner"] = model.module is inner
    torch.manual_seed(0)
    inner = Net()
    ddp_config = {"data_parallel_sharding_strategy": "optim_grads_params"}
    adapter = FullyShardedDataParallel("own", ddp_config, inner, fsdp_unit_modules=[nn.Linear])
    out["fsdp_adapter"] = _check(adapter, inner, "own")  # its own config wins
    torch.manual_seed(0)
    inner = Net()
    out["ddp_adapter"] = _check(DistributedDataParallel("own", None, inner), inner, "own")
    return out


def test_wrappers_resolve_the_inner_module():
    reference = Net()
    names = [n for n, _ in reference.named_parameters()]
    for rank, out in enumerate(run_distributed(_run, 2, timeout=120)):
        assert out["module_is_inner"]
        for wrapper in ("fully_shard", "fsdp_adapter", "ddp_adapter"):
            got = out[wrapper]
            where = f"rank {rank} {wrapper}"
            for key in ("config", "generate_bound", "generate", "layers", "layer_weight"):
                assert got[key], f"{where}: {key}"
            assert got["buffer"], where
            assert "no_such_attribute" in got["missing"] and "Net" in got["missing"], where
            assert got["names"] == names, where
            assert got["buffers"] == ["scale"], where
            assert got["state_keys"] == list(reference.state_dict()), where


def test_uninitialised_wrapper_does_not_recurse():
    for cls in (MegatronFSDP, FullyShardedDataParallel, DistributedDataParallel):
        blank = cls.__new__(cls)  # as unpickling makes it: no __init__, no _modules
        with pytest.raises(AttributeError):
            _ = blank.config
        with pytest.raises(AttributeError):
            _ = blank.module


class Wrapper(InnerModuleAttributes):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.head = nn.Linear(2, 2)  # shadows the inner ``head``


def test_wrapper_own_lookup_comes_first():
    """nn.Module's own parameter/submodule lookup is not shadowed: a name on both the
    wrapper and the wrapped module gives the wrapper's, and pickling a plain subclass
    instance round-trips (no recursion through __getattr__ in __setstate__)."""
    inner = Net()
    wrapper = Wrapper(inner)
    assert wrapper.head is not inner.head and wrapper.config is inner.config
    again = pickle.loads(pickle.dumps(wrapper))
    assert again.config.dim == 8 and torch.equal(again.head.weight, wrapper.head.weight)
