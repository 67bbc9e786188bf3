"""What Megatron-Core 0.19's training loop and optimizer call on the adapters, each
pinned against Megatron-Core's documented behaviour:

- ``finalize_model_grads`` calls ``model.finish_grad_sync(force_all_reduce=...)``:
  accepted by both adapters (and ours passes it on); with the distributed optimizer a
  forced all-reduce is refused rather than silently reduce-scattered.
- ``DistributedDataParallel(config, ddp_config, module, disable_bucketing,
  pg_collection, full_param_layout)``, Megatron-Core's positional order; the
  ``pg_collection``'s ``dp_cp`` group is the data-parallel group (a sub-group of the
  world here); ``full_param_layout`` accepted with a warning.
- ``model.buffers`` is the list of gradient buffers (Megatron-Core's optimizer reads
  it; Megatron-Core's view of fsdp's buffer), ``model.expert_parallel_buffers`` the expert ones, while ``model.buffers()``
  still iterates registered buffers.
- ``enable_forward_pre_hook`` / ``disable_forward_pre_hook(param_sync)`` exist exactly
  with the distributed optimizer and ``overlap_param_gather`` (enabled at construction);
  ``disable`` with ``param_sync`` gathers the parameters.
- ``offload_grad_buffers`` frees the gradient memory, ``restore_grad_buffers`` brings it
  back zeroed, and training goes on with the same gradients.
- ``set_is_first_microbatch`` flags the submodules that have ``is_first_microbatch``
  when the config quantizes (fp8), and nothing otherwise.
- ``sharded_state_dict`` is the wrapped module's.
- ``FullyShardedDataParallel.param_and_grad_buffer`` has ``parameter_groups`` and
  ``copy_main_weights_to_model_weights``; ``find_megatron_fsdp`` finds the
  ``MegatronFSDP`` inside it.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from fsdp_hooks import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
    finalize_model_grads,
    find_megatron_fsdp,
)
from fsdp_mesh.testing import assert_tensors_close, run_distributed
from fsdp_mesh.testing.models import GPT, GPTConfig, token_batch

CFG = GPTConfig(vocab_size=32, max_seq_len=8, dim=16, n_heads=2, n_layers=2)
ROWS = 2


class _WithBuffer(GPT):
    def __init__(self) -> None:
        super().__init__(CFG)
        self.register_buffer("scale", torch.ones(1))
        self.first = nn.Module()
        self.first.is_first_microbatch = False

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return {"prefix": prefix, "offsets": sharded_offsets, "metadata": metadata}


def _loss(model: nn.Module, step: int, group_rank: int, group_size: int) -> torch.Tensor:
    x, y = token_batch(step, group_size * ROWS, CFG.max_seq_len, CFG.vocab_size)
    mine = slice(group_rank * ROWS, (group_rank + 1) * ROWS)
    return F.cross_entropy(model(x[mine]).flatten(0, 1), y[mine].flatten())


def _reference_grads(group_size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    ref = _WithBuffer()
    x, y = token_batch(0, group_size * ROWS, CFG.max_seq_len, CFG.vocab_size)
    F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def _main_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().clone() for n, p in module.named_parameters()}


def _ddp_api() -> dict[str, Any]:
    rank = dist.get_rank()
    # Two data-parallel groups of 2 of the 4 ranks, as Megatron-Core's dp_cp beside tp.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp = groups[rank // 2]
    pgc = SimpleNamespace(dp_cp=dp, tp=None, pp=None, cp=None, ep=None)
    ref = _reference_grads(2)
    out: dict[str, Any] = {}

    torch.manual_seed(0)
    module = _WithBuffer()
    cfg = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=2000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = DistributedDataParallel(None, cfg, module, False, pgc, object())
    out["layout_warning"] = any("full_param_layout" in str(w.message) for w in caught)
    out["dp_ranks"] = dist.get_process_group_ranks(model.data_parallel_group)
    out["buffers"] = (
        # Megatron-Core's view of fsdp's buffer: every trainable parameter, once.
        [p for b in model.buffers for p in b.params]
        == [p for g in model.buffer.groups if g.requires_grad for p in g.params],
        model.expert_parallel_buffers == [],
        [t.shape for t in model.buffers()] == [torch.Size([1])],
    )
    _loss(model, 0, dist.get_rank(dp), 2).backward()
    finalize_model_grads([model], force_all_reduce=False)
    assert_tensors_close(_main_grads(module), ref, where="finalize_model_grads")

    # Offload: the gradient memory is gone; restore: zeroed, and training goes on.
    model.offload_grad_buffers()
    out["offloaded_bytes"] = sum(
        g.main_grad_buffer.data.untyped_storage().nbytes() for g in model.buffer.groups
    )
    model.restore_grad_buffers()
    out["restored_zero"] = all(bool((p.main_grad == 0).all()) for p in module.parameters())
    model.zero_grad_buffer()
    _loss(model, 0, dist.get_rank(dp), 2).backward()
    model.finish_grad_sync(force_all_reduce=True)  # all-reduce anyway here
    assert_tensors_close(_main_grads(module), ref, where="after restore")

    # Forward pre-hooks exist only with the distributed optimizer + overlap_param_gather.
    try:
        model.enable_forward_pre_hook()
    except RuntimeError as err:
        out["hook_refused"] = str(err)

    # set_is_first_microbatch: only a quantizing config flags the modules.
    model.set_is_first_microbatch()
    out["first_without_fp8"] = module.first.is_first_microbatch
    model.config = SimpleNamespace(fp8="hybrid")
    model.set_is_first_microbatch()
    out["first_with_fp8"] = module.first.is_first_microbatch
    out["sharded"] = model.sharded_state_dict("model.", ((0, 1, 2),))

    # Distributed optimizer: enabled at construction, disable gathers the parameters.
    torch.manual_seed(0)
    module = _WithBuffer()
    cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_param_gather=True, bucket_size=2000
    )
    model = DistributedDataParallel(None, cfg, module, pg_collection=pgc)
    try:
        model.enable_forward_pre_hook()
    except RuntimeError as err:
        out["enable_twice"] = str(err)
    _loss(model, 0, dist.get_rank(dp), 2).backward()
    try:
        model.finish_grad_sync(force_all_reduce=True)
    except NotImplementedError as err:
        out["forced_all_reduce"] = str(err)
    model.finish_grad_sync()
    params = model.distributed_optimizer_params()
    opt = torch.optim.SGD(params, lr=0.5)
    opt.step()
    model.disable_forward_pre_hook(param_sync=True)  # installs and gathers the step
    torch.manual_seed(0)
    expected = _WithBuffer()
    with torch.no_grad():
        for name, p in expected.named_parameters():
            p.sub_(0.5 * ref[name])
    assert_tensors_close(
        {n: p.detach() for n, p in module.named_parameters()},
        {n: p.detach() for n, p in expected.named_parameters()},
        where="disable_forward_pre_hook(param_sync=True)",
    )
    model.enable_forward_pre_hook()
    return out


def test_ddp_speaks_megatron_core():
    for rank, out in enumerate(run_distributed(_ddp_api, 4)):
        assert out["layout_warning"]
        assert out["dp_ranks"] == ([0, 1] if rank < 2 else [2, 3])
        assert out["buffers"] == (True, True, True)
        assert out["offloaded_bytes"] == 0 and out["restored_zero"]
        assert (
            "use_distributed_optimizer=True and overlap_param_gather=True" in (out["hook_refused"])
        )
        assert out["first_without_fp8"] is False and out["first_with_fp8"] is True
        assert out["sharded"] == {"prefix": "model.", "offsets": ((0, 1, 2),), "metadata": None}
        assert "already enabled" in out["enable_twice"]
        assert "force_all_reduce=True" in out["forced_all_reduce"]


def _fsdp_api() -> bool:
    ref = _reference_grads(dist.get_world_size())
    torch.manual_seed(0)
    module = _WithBuffer()
    cfg = DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params")
    model = FullyShardedDataParallel(None, cfg, module)
    _loss(model, 0, dist.get_rank(), dist.get_world_size()).backward()
    finalize_model_grads([model], force_all_reduce=True)  # no effect, as in Megatron-Core
    # find_megatron_fsdp walks the .module chain (Megatron-FSDP's utils).
    assert find_megatron_fsdp(model) is model.module
    assert find_megatron_fsdp(module) is None
    pgb = model.param_and_grad_buffer
    assert pgb.parameter_groups is model.module.buffer.groups
    # One SGD step on the main weights, installed through the name Megatron-Core's
    # DistributedOptimizer calls.
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.5 * p.grad)
    pgb.copy_main_weights_to_model_weights()
    torch.manual_seed(0)
    expected = _WithBuffer()
    with torch.no_grad():
        for name, p in expected.named_parameters():
            p.sub_(0.5 * ref[name])
    x, _ = token_batch(1, 2, CFG.max_seq_len, CFG.vocab_size)
    torch.testing.assert_close(model(x), expected(x), rtol=1e-5, atol=1e-6)
    return True


def test_fsdp_adapter_speaks_megatron_core():
    assert all(run_distributed(_fsdp_api, 2))
