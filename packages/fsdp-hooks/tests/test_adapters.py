"""The Megatron-Core style adapters.

- ``DistributedDataParallel`` trains exactly like torch's
  ``torch.nn.parallel.DistributedDataParallel`` (same losses and parameters, step by
  step, with gradient accumulation under ``no_sync``) at world sizes 2 and 4, with
  all-reduce and with the distributed optimizer (reduce-scatter), overlapped or not,
  also over a data-parallel group that is part of the world (two groups of 2 of 4).
- A module in Megatron-Core's style (a ``config`` attribute, a layer that adds its
  weight gradient straight into ``main_grad`` and sets ``grad_added_to_main_grad``)
  trains like the same plain module under torch DDP.
- ``FullyShardedDataParallel`` trains exactly like ``fully_shard`` for every
  ``data_parallel_sharding_strategy``.
- Wrong configurations raise clear errors, before any collective; fields of
  Megatron-Core's config that fsdp does not implement, when set, are named in one
  warning (accepted, ignored).
"""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn import functional as F

from fsdp_hooks import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
    finalize_model_grads,
    fully_shard,
    fully_shard_optimizer,
)
from fsdp_mesh.testing import assert_same_training, run_distributed
from fsdp_mesh.testing.models import GPT, Block, FusedWeightGradLinear, GPTConfig, token_batch

STEPS = 4
MICROBATCHES = 2
GLOBAL_BATCH = 8  # per microbatch; divisible by every world size tested
SEQ_LEN = 8
VOCAB = 64
LR = 1e-2
# Adam divides by sqrt(v) + eps: a gradient that is zero in exact arithmetic (the key
# bias of attention) but rounding noise in practice would get full-size, noise-signed
# updates with a tiny eps. This eps keeps such updates far below the tolerance.
EPS = 1e-4
BUCKET = 3000  # elements: several buckets for the tiny GPT
DDP_SETTINGS = {
    "all_reduce": {"use_distributed_optimizer": False, "overlap_grad_reduce": True},
    "all_reduce_no_overlap": {"use_distributed_optimizer": False, "overlap_grad_reduce": False},
    "distributed_optimizer": {"use_distributed_optimizer": True, "overlap_grad_reduce": True},
    "distributed_optimizer_no_overlap": {
        "use_distributed_optimizer": True,
        "overlap_grad_reduce": False,
    },
}
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def build_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ_LEN, dim=32, n_heads=4, n_layers=2))


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def my_batch(
    step: int, micro: int, group: dist.ProcessGroup | None = None, seed: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the batch of its data-parallel ``group`` (default: world)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    x, y = token_batch(step * MICROBATCHES + micro, GLOBAL_BATCH, SEQ_LEN, VOCAB, seed=seed)
    per_rank = GLOBAL_BATCH // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[mine], y[mine]


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ---- DistributedDataParallel versus torch's DDP (on every rank) -------------------------


def _train_torch_ddp(build, group: dist.ProcessGroup | None = None, seed: int = 3) -> dict:
    module = build()
    model = torch.nn.parallel.DistributedDataParallel(module, process_group=group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        for micro in range(MICROBATCHES):
            last = micro == MICROBATCHES - 1
            with model.no_sync() if not last else _nullcontext():
                loss = loss_fn(model, *my_batch(step, micro, group, seed))
                loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "params": _state(module)}


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _train_ours(
    build,
    setting: dict[str, bool],
    config: object = None,
    group: dist.ProcessGroup | None = None,
    seed: int = 3,
) -> dict[str, Any]:
    module = build()
    model = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(bucket_size=BUCKET),
        module,
        data_parallel_group=group,
        **setting,
    )
    distributed = setting["use_distributed_optimizer"]
    params = model.distributed_optimizer_params() if distributed else list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        model.zero_grad_buffer()
        for micro in range(MICROBATCHES):
            last = micro == MICROBATCHES - 1
            with model.no_sync() if not last else _nullcontext():
                loss = loss_fn(model, *my_batch(step, micro, group, seed))
                loss.backward()
            losses.append(loss.item())
        for p in module.parameters():
            assert p.grad is None, "DDP moves every gradient into main_grad"
        finalize_model_grads([model])
        if distributed:
            optimizer.step()
            model.start_param_sync()
        else:
            model.copy_main_grads_to_grads()
            optimizer.step()
            optimizer.zero_grad()
    stats = model.comm_stats()
    return {"losses": losses, "params": _state(module), "stats": stats}


def _ddp_parity() -> dict[str, Any]:
    out: dict[str, Any] = {"reference": _train_torch_ddp(build_gpt)}
    for name, setting in DDP_SETTINGS.items():
        out[name] = _train_ours(build_gpt, setting)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_matches_torch_ddp(world):
    results = run_distributed(_ddp_parity, world, timeout=240)
    for rank, per_rank in enumerate(results):
        ref = per_rank["reference"]
        for name in DDP_SETTINGS:
            assert_same_training(
                per_rank[name], ref, where=f"world={world} rank={rank} {name}", loss_atol=1e-6
            )
        # All-reduce issues all-reduces only; the distributed optimizer reduce-scatters
        # gradients and all-gathers the stepped parameters.
        stats = per_rank["all_reduce"]["stats"]
        assert stats["all_reduce"]["calls"] > 0 and stats["reduce_scatter"]["calls"] == 0
        stats = per_rank["distributed_optimizer"]["stats"]
        assert stats["reduce_scatter"]["calls"] > 0 and stats["all_reduce"]["calls"] == 0
        assert stats["all_gather"]["calls"] > 0


# A data-parallel group that is part of the world, as Megatron-Core passes it beside
# tensor or pipeline groups: 4 ranks as two groups {0, 2} and {1, 3} (tensor parallelism
# of 2), each training its own model on its own data, exactly like torch's DDP over that
# group; a rank given a group it is not in gets a clear error.
TP = 2


def _ddp_subgroups() -> dict[str, Any]:
    groups = [dist.new_group(list(range(t, dist.get_world_size(), TP))) for t in range(TP)]
    tp_rank = dist.get_rank() % TP
    mine, other = groups[tp_rank], groups[1 - tp_rank]

    def build() -> GPT:
        torch.manual_seed(tp_rank)  # each group its own model
        return GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ_LEN, dim=32, n_heads=4, n_layers=2))

    seed = 10 + tp_rank  # each group its own data
    out: dict[str, Any] = {"reference": _train_torch_ddp(build, mine, seed)}
    for name in ("all_reduce", "distributed_optimizer"):
        out[name] = _train_ours(build, DDP_SETTINGS[name], group=mine, seed=seed)
    try:
        DistributedDataParallel(None, None, build(), data_parallel_group=other)
    except ValueError as err:
        out["foreign_group"] = str(err)
    return out


def test_ddp_over_part_of_the_world_matches_torch_ddp():
    results = run_distributed(_ddp_subgroups, 4, timeout=240)
    for rank, out in enumerate(results):
        for name in ("all_reduce", "distributed_optimizer"):
            assert_same_training(
                out[name], out["reference"], where=f"rank={rank} {name}", loss_atol=1e-6
            )
        assert "not in the data_parallel_group" in out["foreign_group"], out["foreign_group"]
    # One model per group: the same on ranks 0 and 2, another on ranks 1 and 3.
    p = [out["distributed_optimizer"]["params"]["tok.weight"] for out in results]
    assert torch.equal(p[0], p[2]) and torch.equal(p[1], p[3])
    assert not torch.allclose(p[0], p[1])


# ---- a Megatron-Core style module --------------------------------------------------------


class McoreStyleMLP(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.config = SimpleNamespace(calculate_per_token_loss=False)
        self.embed = nn.Embedding(VOCAB, 16)
        self.fc1 = nn.Parameter(torch.randn(32, 16) * 0.2)
        self.fc2 = nn.Linear(32, VOCAB)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = FusedWeightGradLinear.apply(h, self.fc1) if self.fused else h @ self.fc1.t()
        return self.fc2(F.gelu(h))


def _build_fused() -> nn.Module:
    return McoreStyleMLP(fused=True)


def _build_plain() -> nn.Module:
    return McoreStyleMLP(fused=False)


def _mcore_module_parity() -> dict[str, Any]:
    ref = _train_torch_ddp(_build_plain)
    module = _build_fused()
    got = _train_ours(lambda: module, DDP_SETTINGS["all_reduce"], config=module.config)
    return {"reference": ref, "got": got}


def test_mcore_style_module_with_fused_weight_grads():
    for rank, out in enumerate(run_distributed(_mcore_module_parity, 2, timeout=120)):
        assert_same_training(out["got"], out["reference"], where=f"rank={rank}", loss_atol=1e-6)


# ---- DistributedDataParallel: errors that need ranks ----------------------------------


def _ddp_errors() -> dict[str, str]:
    out: dict[str, str] = {}
    model = DistributedDataParallel(None, None, build_gpt())
    try:
        model.distributed_optimizer_params()
    except RuntimeError as err:
        out["params_without_distopt"] = str(err)
    model = DistributedDataParallel(None, None, build_gpt(), check_for_nan_in_grad=True)
    x, y = my_batch(0, 0)
    loss = loss_fn(model, x, y)
    if dist.get_rank() == 1:
        loss = loss * float("nan")
    loss.backward()
    try:
        model.finish_grad_sync()
    except RuntimeError as err:
        out["nan"] = str(err)
    return out


def test_ddp_errors_on_every_rank():
    for out in run_distributed(_ddp_errors, 2, timeout=120):
        assert "use_distributed_optimizer=True" in out["params_without_distopt"]
        assert "rank 1:" in out["nan"] and "rank 0:" not in out["nan"], out["nan"]


def _ddp_state() -> dict[str, Any]:
    rank = dist.get_rank()
    module = build_gpt()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(rank)  # ranks disagree until broadcast_params
    model = DistributedDataParallel(None, None, module, use_distributed_optimizer=True)
    model.broadcast_params()
    after_broadcast = _state(module)
    names = list(model.state_dict())
    ones = {k: torch.ones_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(ones)
    shards_are_ones = all(
        bool((p.to_local() == 1).all()) for p in model.distributed_optimizer_params()
    )
    return {"after_broadcast": after_broadcast, "names": names, "shards": shards_are_ones}


def test_ddp_broadcast_and_state_dict():
    out = run_distributed(_ddp_state, 2, timeout=120)
    reference = build_gpt().state_dict()
    for rank, got in enumerate(out):
        assert got["names"] == list(reference), "state_dict is the module's, unprefixed"
        for name, value in reference.items():
            torch.testing.assert_close(got["after_broadcast"][name], value, msg=f"rank {rank}")
        assert got["shards"], "load_state_dict refreshes the distributed optimizer's shard"


# ---- FullyShardedDataParallel versus fully_shard ----------------------------------------


def _train_fsdp(strategy: str, adapter: bool, outer: str | None = None) -> dict[str, Any]:
    """Train under the adapter or ``fully_shard``; ``outer`` (``"no_shard"`` or
    ``"optim"``) makes it hybrid: 2 replicas of a shard group of consecutive ranks."""
    module = build_gpt()
    if adapter:
        hybrid = {}
        if outer is not None:
            hybrid = {"num_distributed_optimizer_instances": 2, "outer_dp_sharding_strategy": outer}
        cfg = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy, **hybrid)
        model = FullyShardedDataParallel(None, cfg, module, fsdp_unit_modules=[Block])
        optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=LR))
    else:
        mesh = {}
        if outer is not None:
            world = dist.get_world_size()
            mesh = {
                "device_mesh": init_device_mesh(
                    "cpu", (2, world // 2), mesh_dim_names=("dp_outer", "dp_shard")
                ),
                "dp_shard_dim": "dp_shard",
                "dp_outer_dim": "dp_outer",
                "outer_dp_sharding_strategy": outer,
            }
        optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
        model, optimizer = fully_shard(
            module, optimizer, fsdp_unit_modules=[Block], zero_dp_strategy=strategy, **mesh
        )
    losses = []
    for step in range(STEPS):
        for micro in range(MICROBATCHES):
            last = micro == MICROBATCHES - 1
            with model.no_sync() if not last else _nullcontext():
                loss = loss_fn(model, *my_batch(step, micro))
                loss.backward()
            losses.append(loss.item())
        if adapter:
            finalize_model_grads([model])
        optimizer.step()
        optimizer.zero_grad()
    state = {k: v.to_local().detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": state}


def _fsdp_parity() -> dict[str, Any]:
    return {
        s: {"adapter": _train_fsdp(s, adapter=True), "fully_shard": _train_fsdp(s, False)}
        for s in STRATEGIES
    }


def test_fsdp_adapter_matches_fully_shard():
    for rank, out in enumerate(run_distributed(_fsdp_parity, 2, timeout=240)):
        for strategy in STRATEGIES:
            got, ref = out[strategy]["adapter"], out[strategy]["fully_shard"]
            where = f"rank={rank} strategy={strategy}"
            assert got["losses"] == ref["losses"], where
            for name, value in ref["params"].items():
                torch.testing.assert_close(got["params"][name], value, rtol=0, atol=0, msg=where)


HYBRID = (
    ("optim_grads_params", "no_shard"),
    ("optim", "no_shard"),
    ("optim_grads_params", "optim"),
)


def _fsdp_hybrid_parity() -> dict[str, Any]:
    return {
        case: {
            "adapter": _train_fsdp(*case[:1], True, case[1]),
            "fully_shard": _train_fsdp(*case[:1], False, case[1]),
        }
        for case in HYBRID
    }


def test_fsdp_adapter_hybrid_matches_fully_shard():
    """num_distributed_optimizer_instances=2 at 4 ranks is HSDP (outer 'no_shard') or
    fully-sharded HSDP (outer 'optim') over 2 shard groups of consecutive ranks."""
    for rank, out in enumerate(run_distributed(_fsdp_hybrid_parity, 4, timeout=240)):
        for case in HYBRID:
            got, ref = out[case]["adapter"], out[case]["fully_shard"]
            where = f"rank={rank} (inner, outer)={case}"
            assert got["losses"] == ref["losses"], where
            for name, value in ref["params"].items():
                torch.testing.assert_close(got["params"][name], value, rtol=0, atol=0, msg=where)


# ---- configuration errors (no ranks needed: they raise before any collective) -----------


def _fsdp(ddp_config: object, config: object = None) -> None:
    FullyShardedDataParallel(config, ddp_config, nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("ddp_config", "config", "error", "words"),
    [
        (
            {"data_parallel_sharding_strategy": "zero4"},
            None,
            ValueError,
            ["'zero4'", "'optim_grads_params'", "'no_shard'"],
        ),
        (
            {"outer_dp_sharding_strategy": "optim_grads", "num_distributed_optimizer_instances": 2},
            None,
            ValueError,
            ["outer", "allowed: 'no_shard', 'optim'"],
        ),
        (
            {
                "data_parallel_sharding_strategy": "optim_grads",
                "outer_dp_sharding_strategy": "optim",
                "num_distributed_optimizer_instances": 2,
            },
            None,
            ValueError,
            [
                "requires data_parallel_sharding_strategy (zero_dp_strategy) 'optim_grads_params'",
                "'optim_grads'",
            ],
        ),
        (
            {"data_parallel_sharding_strategy": 3, "outer_dp_sharding_strategy": "optim"},
            None,
            ValueError,
            ["no outer dim was given", "num_distributed_optimizer_instances > 1"],
        ),
        (
            {"data_parallel_sharding_strategy": "no_shard"},
            SimpleNamespace(init_model_with_meta_device=True),
            ValueError,
            ["meta-device", "'no_shard'", "sharded strategy"],
        ),
        (
            {"num_distributed_optimizer_instances": 0},
            None,
            ValueError,
            ["positive int"],
        ),
        (
            {
                "data_parallel_sharding_strategy": "optim_grads_params",
                "outer_dp_sharding_strategy": "optim",
                "num_distributed_optimizer_instances": 2,
            },
            None,
            RuntimeError,
            ["torch.distributed is not initialized"],
        ),
        ({"no_such_field": 1}, None, ValueError, ["unknown ddp_config fields", "no_such_field"]),
        (nn.Linear(2, 2), None, TypeError, ["(config, ddp_config, module"]),
        (42, None, TypeError, ["DistributedDataParallelConfig"]),
    ],
)
def test_fsdp_adapter_config_errors(ddp_config, config, error, words):
    with pytest.raises(error) as info:
        _fsdp(ddp_config, config)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        (
            {"ddp_config": DistributedDataParallelConfig(use_megatron_fsdp=True)},
            ValueError,
            ["FullyShardedDataParallel"],
        ),
        (
            {"ddp_config": {"data_parallel_sharding_strategy": "optim_grads_params"}},
            ValueError,
            ["never does", "FullyShardedDataParallel"],
        ),
        (
            {"ddp_config": {"data_parallel_sharding_strategy": "optim"}},
            ValueError,
            ["use_distributed_optimizer=True"],
        ),
        (
            {"ddp_config": {"num_distributed_optimizer_instances": 2}},
            NotImplementedError,
            ["not implemented yet"],
        ),
        ({"ddp_config": nn.Linear(2, 2)}, TypeError, ["(config, ddp_config, module"]),
        ({"ddp_config": None, "module": None}, TypeError, ["module must be an nn.Module"]),
    ],
)
def test_ddp_config_errors(kwargs, error, words):
    kwargs = {"module": nn.Linear(2, 2), **kwargs}
    with pytest.raises(error) as info:
        DistributedDataParallel(None, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_ddp_keywords_override_ddp_config_fields():
    """The older signature's keywords and the ddp_config fields mean the same thing;
    a keyword given wins (checked without ranks through the config helper)."""
    from fsdp_hooks.integrations.megatron_core.ddp_checks import effective_ddp_config

    cfg = effective_ddp_config(
        DistributedDataParallelConfig(overlap_grad_reduce=True, grad_reduce_in_fp32=False),
        accumulate_allreduce_grads_in_fp32=True,
        overlap_grad_reduce=None,
        use_distributed_optimizer=True,
        check_for_nan_in_grad=None,
    )
    assert cfg.grad_reduce_in_fp32 and cfg.overlap_grad_reduce and cfg.use_distributed_optimizer
    assert cfg.data_parallel_sharding_strategy == "optim"


# ---- Megatron-Core's config: fields fsdp does not know -----------------------------------


@dataclasses.dataclass
class McoreDDPConfig:
    """A slice of Megatron-Core's ``DistributedDataParallelConfig``: fields fsdp reads,
    and fields it does not implement (one with a truthy default)."""

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    use_distributed_optimizer: bool = False
    bucket_size: int | None = None
    check_for_large_grads: bool = False
    align_param_gather: bool = False
    pad_buckets_for_high_nccl_busbw: bool = False
    some_truthy_default: int = 4


def _ignored_field_warnings(ddp_config: object) -> list[str]:
    from fsdp_hooks.integrations.megatron_core._common import coerce_ddp_config

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = coerce_ddp_config(ddp_config, "Adapter")
    assert cfg.grad_reduce_in_fp32 == ddp_config.grad_reduce_in_fp32, "known fields carry over"
    return [str(w.message) for w in caught if "does not implement" in str(w.message)]


def test_unknown_mcore_fields_set_are_named_in_one_warning():
    (message,) = _ignored_field_warnings(
        McoreDDPConfig(
            grad_reduce_in_fp32=True,
            check_for_large_grads=True,
            align_param_gather=True,
            some_truthy_default=8,
        )
    )
    assert message.startswith("Adapter: ddp_config (McoreDDPConfig) sets fields"), message
    assert "check_for_large_grads=True, align_param_gather=True, some_truthy_default=8" in message
    assert "accepted and ignored" in message
    # Known fields and unknown ones left at their defaults are not named.
    for quiet in ("grad_reduce_in_fp32", "pad_buckets_for_high_nccl_busbw", "bucket_size"):
        assert quiet not in message, (quiet, message)


@pytest.mark.parametrize(
    "ddp_config",
    [
        McoreDDPConfig(),
        McoreDDPConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
        McoreDDPConfig(some_truthy_default=4),  # its default, though truthy
        McoreDDPConfig(some_truthy_default=0),  # not its default, but falsy: "off"
        SimpleNamespace(grad_reduce_in_fp32=False, check_for_large_grads=False),
    ],
)
def test_unknown_fields_at_default_or_off_are_silent(ddp_config):
    assert _ignored_field_warnings(ddp_config) == []


def test_unknown_field_of_a_plain_object_is_named():
    """Any object with the field names works; without declared defaults, an unknown
    attribute counts as set when it is truthy."""
    (message,) = _ignored_field_warnings(
        SimpleNamespace(grad_reduce_in_fp32=True, align_param_gather=True, _private=1)
    )
    assert "align_param_gather=True" in message and "_private" not in message


@pytest.mark.parametrize("adapter", [DistributedDataParallel, FullyShardedDataParallel])
def test_adapters_warn_about_unknown_fields_before_anything_else(adapter):
    """Through the public constructors (which then stop: no process group here)."""
    with (
        pytest.warns(UserWarning, match="sets fields fsdp does not implement: check_for_large"),
        pytest.raises(RuntimeError, match=r"torch\.distributed is not initialized"),
    ):
        adapter(None, McoreDDPConfig(check_for_large_grads=True), nn.Linear(2, 2))
