"""The ``fsdp`` meta-package: the names users call, and the layers' versions."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import fsdp

# fsdp's public surface, written out: a name added to or removed from ``fsdp.__all__``
# must be added or removed here too, on purpose. Internals stay in their layer.
PUBLIC = {
    "fsdp_mesh": ["FSDPDistributedIndex", "build_device_mesh"],
    "fsdp_buffers": [
        "AllGatherPipeline",
        "DataParallelBuffer",
        "GradReducePipeline",
        "MixedPrecisionPolicy",
        "ParameterGroup",
        "ShardingStrategy",
        "fsdp_no_shard",
    ],
    "fsdp_hooks": [
        "DistributedDataParallel",
        "DistributedDataParallelConfig",
        "FullyShardedDataParallel",
        "MegatronFSDP",
        "TrainingState",
        "finalize_model_grads",
        "from_pretrained",
        "fully_shard",
        "fully_shard_model",
        "fully_shard_optimizer",
        "save_pretrained",
    ],
    "fsdp_ckpt": [
        "CheckpointError",
        "CheckpointMismatchError",
        "CorruptCheckpointError",
        "ForeignCheckpointWarning",
        "HostStager",
        "IncompleteCheckpointError",
        "SaveHandle",
        "consolidate_checkpoint",
        "get_full_model_state_dict",
        "get_model_state_dict",
        "get_optimizer_state_dict",
        "load_checkpoint",
        "load_full_state_dict",
        "save_checkpoint",
        "save_full_model_state_dict",
        "set_model_state_dict",
        "set_optimizer_state_dict",
    ],
    "fsdp_plan": ["Plan", "plan"],
    "fsdp": ["__version__", "versions"],
}

# What a Megatron-FSDP user imports from ``megatron_fsdp`` (and its submodules).
MEGATRON_FSDP_NAMES = [
    "DistributedDataParallelConfig",
    "FSDPDistributedIndex",
    "MegatronFSDP",
    "MixedPrecisionPolicy",
    "fully_shard",
    "fully_shard_model",
    "fully_shard_optimizer",
    "ParameterGroup",
    "DataParallelBuffer",
    "AllGatherPipeline",
    "GradReducePipeline",
    "TrainingState",
    "fsdp_no_shard",
]

# Internals that fsdp once re-exported: importable from their module, not from fsdp
# (nor, for those other layers build with, from their layer's root).
INTERNALS = {
    "fsdp_buffers": ["ParamAndGradBuffer", "PrefetchOrder", "compute_layout"],
    "fsdp_buffers.bucket": ["GradState", "GroupSharding"],
    "fsdp_buffers.collectives": ["CollectiveKind", "CommStats", "PendingCollective"],
    "fsdp_buffers.data_parallel_buffer": ["BucketAllocator", "TemporaryBucketAllocator"],
    "fsdp_buffers.layout": ["ParamSlot"],
    "fsdp_buffers.tensor_parallel": ["TPKind", "tensor_parallel_specs"],
    "fsdp_hooks.runtime.backward": ["RegisterFSDPBackwardFunction"],
    "fsdp_hooks.runtime.hooks": ["FSDPUnit"],
    "fsdp_mesh": ["current_device"],
    "fsdp_mesh.device": ["warn_once"],
}


def test_all_is_the_documented_public_surface():
    documented = sorted(n for names in PUBLIC.values() for n in names)
    assert len(documented) == len(set(documented)), "a name is listed twice"
    assert sorted(fsdp.__all__) == documented


@pytest.mark.parametrize("layer", [layer for layer in PUBLIC if layer != "fsdp"])
def test_each_public_name_is_its_layers_own(layer):
    module = importlib.import_module(layer)
    for name in PUBLIC[layer]:
        assert getattr(fsdp, name) is getattr(module, name), f"fsdp.{name} is not {layer}'s"


def test_megatron_fsdp_names_are_public():
    missing = [n for n in MEGATRON_FSDP_NAMES if n not in fsdp.__all__]
    assert not missing, f"Megatron-FSDP users import {missing} from the package"


def test_star_import_gives_exactly_all():
    namespace: dict[str, object] = {}
    exec("from fsdp import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(fsdp.__all__)


@pytest.mark.parametrize("where", sorted(INTERNALS))
def test_internals_stay_in_their_layer(where):
    module = importlib.import_module(where)
    layer = importlib.import_module(where.split(".")[0])
    for name in INTERNALS[where]:
        assert getattr(module, name) is not None
        assert not hasattr(fsdp, name), f"fsdp.{name} should be imported from {where}"
        if where != layer.__name__:
            assert name not in layer.__all__, f"{name} is internal to {where}"


def test_versions_of_every_layer():
    versions = fsdp.versions()
    for dist in (
        "fsdp", "fsdp-mesh", "fsdp-buffers", "fsdp-hooks", "fsdp-ckpt", "fsdp-plan", "torch"
    ):  # fmt: skip
        assert versions[dist] not in ("", "not installed"), versions
    assert versions["fsdp"] == fsdp.__version__
    out = subprocess.run(
        [sys.executable, "-m", "fsdp"], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert "fsdp-hooks" in out and fsdp.__version__ in out, out
