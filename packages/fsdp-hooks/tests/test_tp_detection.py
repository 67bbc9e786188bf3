"""Tensor-parallel modes from module classes, as Megatron-Core's FSDP adapter reads them.

* The rules (``FullyShardedDataParallel._detect_parallelism_type``, Megatron-Core 0.19's):
  registered classes, a row module's bias replicated, ``TELayerNormColumnParallelLinear``'s
  layer-norm parameters replicated, a module's ``tensor_model_parallel``/``partition_dim``,
  norm classes by name, ``TELinear``'s ``parallel_mode``, and nothing for anything else.
* End to end: ``test_tensor_parallel``'s Megatron-style model with the tensor-parallel
  marks stripped from its parameters (only the module classes ``ColumnParallelLinear`` /
  ``RowParallelLinear`` tell), wrapped by ``FullyShardedDataParallel`` on a (dp_shard 2,
  tp 2) mesh, trains like one process. Without the class registry its tp-split weights
  were taken as replicated (and refused: their values differ across tp ranks).
"""

from __future__ import annotations

import torch
from torch import nn

from fsdp_hooks import FullyShardedDataParallel, fully_shard_optimizer
from fsdp_mesh import FSDPDistributedIndex
from fsdp_mesh.testing import load_sibling, run_distributed

tp = load_sibling(__file__, "test_tensor_parallel.py")


def _named(cls_name: str, **attrs) -> nn.Module:
    """An ``nn.Linear`` (weight, bias) of class ``cls_name`` with ``attrs`` set."""
    module = type(cls_name, (nn.Linear,), {})(2, 2)
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def test_detection_rules():
    cls = FullyShardedDataParallel  # the methods read only the class's registry
    registry = cls._MODULE_TYPE_REGISTRY
    assert {"column", "row", "replicated"} == set(registry)
    cases = [
        ("weight", _named("ColumnParallelLinear"), "column"),
        ("bias", _named("TEColumnParallelLinear"), "column"),
        ("weight", _named("TERowParallelLinear"), "row"),
        ("bias", _named("RowParallelLinear"), "replicated"),
        ("layer_norm_weight", _named("TELayerNormColumnParallelLinear"), "replicated"),
        ("layer_norm_bias", _named("TELayerNormColumnParallelLinear"), "replicated"),
        ("weight", _named("TELayerNormColumnParallelLinear"), "column"),
        ("weight", _named("TopKRouter"), "replicated"),
        ("weight", _named("Custom", tensor_model_parallel=False), "replicated"),
        ("weight", _named("Custom", tensor_model_parallel=True, partition_dim=0), "column"),
        ("weight", _named("Custom", tensor_model_parallel=True, partition_dim=1), "row"),
        ("bias", _named("Custom", tensor_model_parallel=True, partition_dim=1), "replicated"),
        ("weight", _named("MyQKNormalization"), "replicated"),
        ("weight", _named("TELinear", parallel_mode="column"), "column"),
        ("weight", _named("TELinear", parallel_mode="row"), "row"),
        ("bias", _named("TELinear", parallel_mode="row"), "replicated"),
        ("weight", _named("TELinear", parallel_mode=None), "replicated"),
        ("weight", nn.Linear(2, 2), None),
    ]
    for name, module, want in cases:
        assert cls._detect_parallelism_type(cls, name, module) == want, (
            type(module).__name__,
            name,
        )


def _strip_marks(net: nn.Module) -> None:
    for p in net.parameters():
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(p, attr):
                delattr(p, attr)


def _job():
    mesh = tp._mesh()
    net = tp._net("megatron", mesh)
    _strip_marks(net)
    originals = dict(net.named_parameters())  # the wrapper replaces them by DTensors
    index = FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard", tp_dim="tp")
    model = FullyShardedDataParallel(
        None,
        {"data_parallel_sharding_strategy": "optim_grads_params"},
        net,
        fsdp_unit_modules=[tp.Block],
        dist_index=index,
    )
    opt = fully_shard_optimizer(tp._optimizer(model.parameters()))
    modes = {n: getattr(p, "_tensor_parallel_mode", None) for n, p in originals.items()}
    kinds = {
        n: model.module.buffer.tp.spec(p).kind.name
        for n, _g, _i, p in model.module.buffer.named_params()
    }
    losses, norms = tp._train(model, opt, 0, tp.STEPS)
    return {"modes": modes, "kinds": kinds, "losses": losses, "norms": norms}


def test_adapter_detects_tensor_parallel_layers_by_class():
    ref_losses, ref_norms, _params = tp._reference()
    for out in run_distributed(_job, tp.WORLD, timeout=180):
        assert out["modes"]["blocks.0.up.weight"] == out["modes"]["blocks.0.up.bias"] == "column"
        assert out["modes"]["blocks.1.down.weight"] == "row"
        assert out["modes"]["blocks.1.down.bias"] == "replicated"
        assert out["kinds"]["blocks.0.up.weight"] == out["kinds"]["blocks.0.down.weight"] == "MCORE"
        assert out["kinds"]["blocks.0.down.bias"] == "REPLICATED"
        torch.testing.assert_close(out["losses"], ref_losses[: tp.STEPS], rtol=1e-5, atol=0)
        torch.testing.assert_close(out["norms"], ref_norms[: tp.STEPS], rtol=1e-5, atol=0)
