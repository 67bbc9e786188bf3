"""Behaviours of megatron_fsdp 0.6.1's ``MegatronFSDP`` / ``fully_shard`` that code
written for it relies on, each pinned here against a one-process reference or the
documented Megatron-FSDP behaviour:

- ``param.grad`` stays empty (None) after a backward that did not reduce every gradient
  (automatic sync off, or under ``no_sync``) and is the reduced gradient after
  ``finish_grad_sync()``; clipping before the sync cannot read local gradients.
- The constructor's positional order (4th: ``mixed_precision_policy``); with
  ``ddp_config=None`` the strategy is ``optim_grads_params`` with overlapped reduction.
- ``param_and_grad_buffer`` (``parameter_groups``, ``copy_main_weights_to_model_weights``),
  ``mp_policy``, ``reset_mixed_precision_policy`` / ``mixed_precision_context`` (main
  dtypes kept, ``grad_comm_dtype`` taken), ``microbatch_count`` (backwards since the last
  ``finish_grad_sync``), ``is_last_microbatch`` (a backward with it set reduces and
  attaches gradients), ``finish_grad_sync(force_all_reduce=...)`` accepted.
- Meta-device initialization also calls ``_reset_parameters()`` (``nn.MultiheadAttention``
  defines only that): the weights equal the eager construction's, bit for bit.
- ``tp_dim`` naming a dim of 2 ranks over a model with no tensor-parallel parameter:
  accepted, every parameter replicated over tp, training equal to the reference.
- ``fully_shard(module, optimizer, device_mesh, dp_shard_dim, ...)``: positional
  arguments in megatron_fsdp's order.
- A dense model's index has no expert mesh (``expt_device_mesh`` None).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_buffers import MixedPrecisionPolicy
from fsdp_hooks import (
    DistributedDataParallelConfig,
    MegatronFSDP,
    finalize_model_grads,
    fully_shard,
)
from fsdp_mesh import FSDPDistributedIndex, build_device_mesh
from fsdp_mesh.testing import assert_tensors_close, run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

CFG = GPTConfig(vocab_size=32, max_seq_len=8, dim=16, n_heads=2, n_layers=2)
ROWS = 2  # per rank
LR = 0.1


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor on a 1-D mesh: Shard(0) pieces are row ranges in
    rank order (DTensor's contract), so the gathered pieces concatenate to it."""
    if not isinstance(t, DTensor):
        return t
    assert t.device_mesh.ndim == 1, t.device_mesh
    if isinstance(t.placements[0], Replicate):
        return t.to_local()
    assert t.placements[0] == Shard(0), t.placements
    pieces: list[Any] = [None] * t.device_mesh.size()
    dist.all_gather_object(pieces, t.to_local().detach(), group=t.device_mesh.get_group())
    return torch.cat(pieces)


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: _full(p.grad).detach().clone() for n, p in module.named_parameters()}


def _reference_grads(world: int, step: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    ref = GPT(CFG)
    x, y = token_batch(step, world * ROWS, CFG.max_seq_len, CFG.vocab_size)
    ref.loss(x, y).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def _my_rows(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = token_batch(step, world * ROWS, CFG.max_seq_len, CFG.vocab_size)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    return x[mine], y[mine]


def _index() -> FSDPDistributedIndex:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    return FSDPDistributedIndex(mesh, dp_shard_dim="dp")


# ---- grads, constructor, wrapper attributes --------------------------------------------
def _grads_and_wrapper() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = _reference_grads(world)
    x, y = _my_rows(0, rank, world)
    out: dict[str, Any] = {}

    # Positional: (module, dist_index, ddp_config, mixed_precision_policy, ...).
    torch.manual_seed(0)
    policy = MixedPrecisionPolicy(main_params_dtype=torch.float32)
    model = MegatronFSDP(GPT(CFG), _index(), None, policy, [Block])
    out["mp_policy_is_given"] = model.mp_policy is policy
    out["default_strategy"] = model.ddp_config.data_parallel_sharding_strategy
    out["default_overlap"] = (
        model.ddp_config.overlap_grad_reduce,
        model.ddp_config.overlap_param_gather,
    )
    out["auto_sync"] = model.model_auto_sync
    # Automatic sync off: no .grad until finish_grad_sync, even under ZeRO-3 where
    # each backward reduce-scatters.
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    out["grads_before_finish"] = [n for n, p in model.named_parameters() if p.grad is not None]
    out["microbatch_count"] = model.microbatch_count
    finalize_model_grads([model], force_all_reduce=False)
    assert_tensors_close(_grads(model.module), ref, where="after finish_grad_sync")
    out["microbatch_count_after"] = model.microbatch_count

    # param_and_grad_buffer: what Megatron-Core's DistributedOptimizer reads.
    pgb = model.param_and_grad_buffer
    out["pgb_stable"] = pgb is model.param_and_grad_buffer
    out["groups_are_buffers"] = pgb.parameter_groups is model.buffer.groups
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().mul_(0.5)  # a "step" on the main weights
    pgb.copy_main_weights_to_model_weights()
    torch.manual_seed(0)
    expected = GPT(CFG)
    with torch.no_grad():
        for p in expected.parameters():
            p.mul_(0.5)
    assert torch.equal(model(x), expected(x)), "copy_main_weights_to_model_weights"

    # reset_mixed_precision_policy: main dtypes kept, grad_comm_dtype taken.
    bf16 = MixedPrecisionPolicy(main_params_dtype=None, grad_comm_dtype=torch.bfloat16)
    with model.mixed_precision_context(bf16):
        out["in_context"] = (model.mp_policy, model.buffer.policy)
    out["after_context"] = model.mp_policy

    # no_shard, auto sync off: is_last_microbatch makes a backward reduce and attach.
    torch.manual_seed(0)
    model = MegatronFSDP(
        GPT(CFG), _index(), DistributedDataParallelConfig(data_parallel_sharding_strategy=0)
    )
    model.comm_stats(reset=True)
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    out["no_shard_deferred"] = (
        model.comm_stats(reset=True)["all_reduce"]["calls"],
        [n for n, p in model.named_parameters() if p.grad is not None],
    )
    model.zero_grad_buffer()
    model.is_last_microbatch = True
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    out["last_microbatch_reduced"] = model.comm_stats(reset=True)["all_reduce"]["calls"] > 0
    assert_tensors_close(_grads(model.module), ref, where="is_last_microbatch")

    # fully_shard (automatic sync on): under no_sync .grad stays empty; the synced
    # backward after it attaches the sum of both microbatches.
    torch.manual_seed(0)
    module = GPT(CFG)
    fmodel, _opt = fully_shard(
        module, torch.optim.SGD(module.parameters(), lr=LR), zero_dp_strategy=0
    )
    with fmodel.no_sync():
        (torch.nn.functional.cross_entropy(fmodel(x).flatten(0, 1), y.flatten()) / 2).backward()
    out["grads_under_no_sync"] = [n for n, p in fmodel.named_parameters() if p.grad is not None]
    (torch.nn.functional.cross_entropy(fmodel(x).flatten(0, 1), y.flatten()) / 2).backward()
    assert_tensors_close(_grads(fmodel.module), ref, where="no_sync then sync")
    out["dense_expt_mesh"] = fmodel.dist_index.expt_device_mesh
    return out


def test_grads_and_wrapper_attributes_match_megatron_fsdp():
    for out in run_distributed(_grads_and_wrapper, 2):
        assert out["mp_policy_is_given"]
        assert out["default_strategy"] == "optim_grads_params"
        assert out["default_overlap"] == (True, True)
        assert out["auto_sync"] is False
        assert out["grads_before_finish"] == []
        assert out["microbatch_count"] == 1 and out["microbatch_count_after"] == 0
        assert out["pgb_stable"] and out["groups_are_buffers"]
        in_policy, buffer_policy = out["in_context"]
        assert in_policy == buffer_policy == MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16)
        assert out["after_context"] == MixedPrecisionPolicy(main_params_dtype=torch.float32)
        calls, attached = out["no_shard_deferred"]
        assert calls == 0 and attached == []
        assert out["last_microbatch_reduced"]
        assert out["grads_under_no_sync"] == []
        assert out["dense_expt_mesh"] is None


# ---- meta-device init with _reset_parameters ---------------------------------------------
class _AttnNet(nn.Module):
    """``nn.MultiheadAttention`` defines only ``_reset_parameters()``."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(x, x, x, need_weights=False)[0])


def _meta_reset_parameters() -> bool:
    torch.manual_seed(1)
    eager = _AttnNet()
    torch.manual_seed(1)
    with torch.device("meta"):
        net = _AttnNet()
    model = MegatronFSDP(
        net,
        _index(),
        DistributedDataParallelConfig(data_parallel_sharding_strategy=3),
        init_model_with_meta_device=True,
    )
    got = model.buffer.views.full_parameters()
    expected = dict(eager.named_parameters())
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value.detach()), name
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(5))
    assert torch.equal(model(x), eager(x))
    return True


def test_meta_init_calls_underscore_reset_parameters():
    assert all(run_distributed(_meta_reset_parameters, 2))


# ---- tp_dim over a model with no tensor-parallel parameters ------------------------------
STEPS = 2


def _tp_over_plain_model() -> list[float]:
    meshes = build_device_mesh(dp_shard=2, tp=2)
    index_rank = meshes.device_mesh["dp_shard"].get_local_rank()
    torch.manual_seed(0)
    module = GPT(CFG)
    model, opt = fully_shard(
        module,
        torch.optim.SGD(module.parameters(), lr=LR),
        device_mesh=meshes.device_mesh,
        dp_shard_dim="dp_shard",
        tp_dim="tp",
        fsdp_unit_modules=[Block],
    )
    torch.manual_seed(0)
    ref = GPT(CFG)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(STEPS):
        # Every tp rank of a dp rank sees the same rows (tensor parallelism's contract).
        x, y = _my_rows(step, index_rank, 2)
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
        gx, gy = token_batch(step, 2 * ROWS, CFG.max_seq_len, CFG.vocab_size)
        ref.loss(gx, gy).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        got = model.buffer.views.full_parameters()
        expected = {n: p.detach() for n, p in ref.named_parameters()}
        assert_tensors_close(got, expected, where=f"step {step}")
    return [float(meshes.device_mesh["tp"].size())]


def test_tp_dim_over_model_without_tensor_parallel_parameters():
    for out in run_distributed(_tp_over_plain_model, 4):
        assert out == [2.0]


# ---- fully_shard positional arguments -------------------------------------------------------
def _positional_fully_shard() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    module = GPT(CFG)
    # megatron_fsdp's order: module, optimizer, device_mesh, dp_shard_dim, dp_outer_dim,
    # tp_dim, hybrid_fsdp_group, hybrid_fsdp_expt_group, expt_device_mesh,
    # fsdp_group_ag, expt_fsdp_group_ag, fsdp_unit_modules, zero_dp_strategy, ...
    model, _ = fully_shard(
        module,
        torch.optim.SGD(module.parameters(), lr=LR),
        mesh,
        "dp",
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        [Block],
        2,
    )
    out = {"strategy": model.ddp_config.data_parallel_sharding_strategy, "dim": None}
    out["dim"] = model.dist_index.dp_shard_dim
    out["units"] = len(model.hooks.units)
    errors = {}
    for key, call in {
        "twice": lambda m: fully_shard(m, torch.optim.SGD(m.parameters()), mesh, device_mesh=mesh),
        "too_many": lambda m: fully_shard(m, torch.optim.SGD(m.parameters()), *([None] * 40)),
    }.items():
        try:
            call(GPT(CFG))
        except TypeError as err:
            errors[key] = str(err)
    out["errors"] = errors
    return out


def test_fully_shard_takes_megatron_positional_arguments():
    for out in run_distributed(_positional_fully_shard, 2):
        assert out["strategy"] == "optim_grads" and out["dim"] == "dp"
        assert out["units"] == CFG.n_layers
        assert "multiple values for argument 'device_mesh'" in out["errors"]["twice"]
        assert "positional arguments" in out["errors"]["too_many"]
