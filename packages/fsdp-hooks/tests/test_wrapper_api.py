"""The wrapper's public API: Megatron-FSDP's methods, ``TrainingState``, tied weights,
CUDA-only options on CPU, the unit summary, the default mesh and optimizer groups."""

import logging
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from fsdp_buffers import BucketStatus, fsdp_no_shard
from fsdp_buffers.bucket import GradState
from fsdp_buffers.data_parallel_buffer import TemporaryBucketAllocator
from fsdp_hooks import (
    DistributedDataParallelConfig,
    MegatronFSDP,
    TrainingState,
    fully_shard,
    fully_shard_model,
)
from fsdp_mesh.testing import run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

CFG = GPTConfig(vocab_size=40, max_seq_len=8, dim=16, n_heads=2, n_layers=2)
CFG3 = GPTConfig(vocab_size=40, max_seq_len=8, dim=16, n_heads=2, n_layers=3)
ROWS = 2
WORLD = 2
STEPS = 2


def _gpt(cfg=CFG):
    torch.manual_seed(0)
    return GPT(cfg)


def _data(step, rank):
    return token_batch(100 * step + rank, ROWS, CFG.max_seq_len, CFG.vocab_size, seed=3)


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _groups(module):
    """Two optimizer groups: matrices with weight decay, vectors without (and a
    different learning rate)."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    rest = [p for p in module.parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": rest, "weight_decay": 0.0, "lr": 0.05},
    ]


def _sgd(module):
    return torch.optim.SGD(_groups(module), lr=0.2, momentum=0.9)


def _compute_params(model):
    return {n: p for n, _g, _i, p in model.buffer.named_params()}


def _rows(model, name, full):
    r0, r1 = model.buffer.views.local_rows(name)
    return full[r0:r1]


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records = []

    def emit(self, record):
        self.records.append(record)


# ---- state, tied weights, summary, default mesh, optimizer groups ---------------------


def _state_body():
    rank, world = dist.get_rank(), dist.get_world_size()
    logger = logging.getLogger("fsdp_hooks")
    capture = _Capture()
    logger.addHandler(capture)
    logger.setLevel(logging.INFO)
    module = _gpt(CFG3)
    fsdp_no_shard(module.blocks[2])
    names = {id(p): n for n, p in module.named_parameters()}
    group_names = [[names[id(p)] for p in g["params"]] for g in _groups(module)]
    # One row per unit in the summary: no coalescing.
    model, opt = fully_shard(
        module, _sgd(module), fsdp_unit_modules=[Block], suggested_communication_unit_size=0
    )
    logger.removeHandler(capture)

    # The unit summary: once, on rank 0 only, every unit with its count and bytes.
    if rank == 0:
        assert len(capture.records) == 1
        text = capture.records[0].getMessage()
        for unit, mode in (("blocks.0", "sharded"), ("blocks.2", "no_shard")):
            count = sum(p.numel() for p in _gpt(CFG3).get_submodule(unit).parameters())
            assert re.search(
                rf"^  {re.escape(unit)}: {count:,} params, {4 * count:,} bytes, {mode}, ",
                text,
                re.M,
            ), text
        outside = sum(p.numel() for n, p in _gpt(CFG3).named_parameters() if "blocks" not in n)
        assert f"  (outside units): {outside:,} params, {4 * outside:,} bytes, sharded" in text
    else:
        assert capture.records == []

    # Default mesh: 1-D over the whole world.
    mesh = model.get_distributed_index().device_mesh
    assert mesh.ndim == 1 and mesh.size() == world and mesh.device_type == "cpu"
    assert mesh.mesh.tolist() == list(range(world))
    assert model.get_distributed_index().fsdp_size == world

    # Optimizer groups: kept, with their hyperparameters, over the DTensor parameters.
    assert len(opt.param_groups) == 2
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[0]["lr"] == 0.2
    assert opt.param_groups[1]["weight_decay"] == 0.0 and opt.param_groups[1]["lr"] == 0.05
    distributed = dict(model.module.named_parameters())
    for group, expected in zip(opt.param_groups, group_names, strict=True):
        assert [id(p) for p in group["params"]] == [id(distributed[n]) for n in expected]
        assert all(isinstance(p, DTensor) for p in group["params"])

    # Tied weights: one object under both names, outside and inside forward.
    m = model.module
    assert m.head.weight is m.tok.weight and isinstance(m.tok.weight, DTensor)

    # TrainingState at hooks of submodules (forward) and of activations (backward).
    units = model.hooks.units
    assert [u.name for u in units] == ["blocks.0", "blocks.1", "blocks.2"]
    seen = []

    def record(tag):
        seen.append(
            (
                tag,
                model.training_state,
                tuple(model.unit_training_state(i) for i in range(len(units))),
                m.head.weight is m.tok.weight and not isinstance(m.tok.weight, DTensor),
            )
        )

    handles = [
        m.blocks[0].attn.register_forward_pre_hook(lambda *_: record("fwd blocks.0")),
        m.blocks[1].attn.register_forward_pre_hook(lambda *_: record("fwd blocks.1")),
        m.blocks[2].attn.register_forward_pre_hook(lambda *_: record("fwd blocks.2")),
        m.ln_f.register_forward_pre_hook(lambda *_: record("fwd ln_f")),
    ]

    def hook_output(i):
        def post_forward(_module, _args, out):
            out.register_hook(lambda _grad: record(f"bwd blocks.{i}"))

        return post_forward

    handles += [m.blocks[i].register_forward_hook(hook_output(i)) for i in range(3)]
    f_, p_, q_, i_ = (
        TrainingState.FORWARD,
        TrainingState.PRE_BACKWARD,
        TrainingState.POST_BACKWARD,
        TrainingState.IDLE,
    )
    # A unit is FORWARD inside its forward, PRE_BACKWARD from the first gradient at
    # its outputs, POST_BACKWARD once the gradients of its inputs exist. blocks.2 is
    # entirely fsdp_no_shard: its hooks only track this state (nothing is gathered).
    expected = [
        ("fwd blocks.0", f_, (f_, i_, i_), True),
        ("fwd blocks.1", f_, (i_, f_, i_), True),
        ("fwd blocks.2", f_, (i_, i_, f_), True),
        ("fwd ln_f", f_, (i_, i_, i_), True),
        ("bwd blocks.2", p_, (i_, i_, p_), True),
        ("bwd blocks.1", p_, (i_, p_, q_), True),
        ("bwd blocks.0", p_, (p_, q_, q_), True),
    ]
    ref = _gpt(CFG3)
    ref_opt = torch.optim.SGD(_groups(ref), lr=0.2, momentum=0.9)
    for step in range(STEPS):
        assert model.training_state is i_
        seen.clear()
        x, y = _data(step, rank)
        loss = _loss(model, x, y)
        assert model.training_state is i_  # between forward and backward
        loss.backward()
        assert seen == expected, seen
        assert model.training_state is i_
        assert all(u.state is i_ for u in units)
        opt.step()
        opt.zero_grad()
        # Reference: the mean loss over both ranks' rows.
        xs, ys = zip(*(_data(step, r) for r in range(world)), strict=True)
        _loss(ref, torch.cat(xs), torch.cat(ys)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for h in handles:
        h.remove()

    # Tied weights after steps: both names in the state dict, equal, and trained
    # like one process (decay group hyperparameters included).
    sd = model.state_dict()
    tok = next(v for k, v in sd.items() if k.endswith("tok.weight"))
    head = next(v for k, v in sd.items() if k.endswith("head.weight"))
    torch.testing.assert_close(tok.to_local(), head.to_local(), rtol=0, atol=0)
    ref_params = dict(ref.named_parameters())
    for name, p in model.module.named_parameters():
        expected_full = ref_params[name].detach()
        if name.startswith("blocks.2."):  # no_shard: replicated, whole parameter
            local_expected = expected_full
        else:
            local_expected = _rows(model, name, expected_full)
        torch.testing.assert_close(p.to_local(), local_expected, rtol=1e-5, atol=1e-6)
    assert m.head.weight is m.tok.weight
    return True


def test_state_tied_weights_summary_default_mesh_and_param_groups():
    assert run_distributed(_state_body, WORLD) == [True, True]


# ---- the Megatron-FSDP methods ---------------------------------------------------------


def _ref_output(x, shift=0.0):
    ref = _gpt()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(shift)
        return ref(x)


def _local_grad_mean(world):
    grads = []
    for r in range(world):
        ref = _gpt()
        _loss(ref, *_data(0, r)).backward()
        grads.append({n: p.grad for n, p in ref.named_parameters()})
    return {n: sum(g[n] for g in grads) / world for n in grads[0]}


def _grads(model):
    return {n: p.grad.to_local().clone() for n, p in model.module.named_parameters()}


def _check_grads(model, expected_full):
    for name, p in model.module.named_parameters():
        full = expected_full[name]
        if p.to_local().shape != full.shape:
            full = _rows(model, name, full)
        torch.testing.assert_close(p.grad.to_local(), full, rtol=1e-5, atol=1e-7)


def _methods_body(strategy):
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    from fsdp_mesh import FSDPDistributedIndex

    index = FSDPDistributedIndex(mesh, dp_shard_dim="dp")
    module = _gpt()
    model = MegatronFSDP(
        module,
        index,
        ddp_config=DistributedDataParallelConfig(
            data_parallel_sharding_strategy=strategy,
            overlap_param_gather=True,
            suggested_communication_unit_size=0,  # buckets per unit
        ),
        fsdp_unit_modules=[Block],
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    from fsdp_hooks import fully_shard_optimizer

    opt = fully_shard_optimizer(opt)
    assert model.get_distributed_index() is index
    pipeline = model.all_gather_pipeline
    compute = _compute_params(model)
    ref_params = dict(_gpt().named_parameters())
    x, _y = _data(0, rank)

    # forward: the same as calling the model, and as one process; no_grad forward
    # leaves nothing gathered.
    with torch.no_grad():
        torch.testing.assert_close(model.forward(x), _ref_output(x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model(x), _ref_output(x), rtol=1e-5, atol=1e-6)
    assert pipeline.gathered_buckets() == []
    assert model.training_state is TrainingState.IDLE

    unit_groups = [u.groups for u in model.hooks.units]
    if strategy == 3:
        # all_gather_and_wait_parameters_ready: the buckets of the given parameters
        # (DTensor or compute ones), plus the prefetch of the next unit when asked.
        model.all_gather_and_wait_parameters_ready(
            model.module.blocks[0].parameters(), prefetch=False
        )
        assert pipeline.gathered_buckets() == unit_groups[0]
        for n, p in compute.items():
            if n.startswith("blocks.0."):
                torch.testing.assert_close(p.detach(), ref_params[n].detach())
        pipeline.reset()
        model.all_gather_and_wait_parameters_ready(
            [compute["blocks.0.ln1.weight"]], prefetch=True, wait_bucket_ready=False
        )
        assert pipeline.gathered_buckets() == unit_groups[0] + unit_groups[1]
        pipeline.reset()

        # start_param_sync: every sharded bucket; dispatched or waited.
        sharded = [g for g in range(model.buffer.num_buckets) if pipeline.is_distributed(g)]
        model.start_param_sync(force_sync=True)
        assert all(pipeline.status[g] is BucketStatus.READY_TO_USE for g in sharded)
        for n, p in compute.items():
            torch.testing.assert_close(p.detach(), ref_params[n].detach())
        pipeline.reset()
        model.start_param_sync(force_dispatch=True)
        assert all(pipeline.status[g] is BucketStatus.GATHER_IN_PROGRESS for g in sharded)
        model.synchronize_param_gather()
        assert all(pipeline.status[g] is BucketStatus.READY_TO_USE for g in sharded)
        pipeline.reset()
        model.start_param_sync()  # overlap_param_gather=True: dispatched only
        assert all(pipeline.status[g] is BucketStatus.GATHER_IN_PROGRESS for g in sharded)
        model.synchronize_param_gather()
    else:
        # Replicated compute weights: nothing to gather, ever.
        model.start_param_sync(force_sync=True)
        model.all_gather_and_wait_parameters_ready(model.module.parameters())
        assert model.comm_stats(reset=True)["all_gather"]["calls"] == 0

    # no_sync / sync / set_model_auto_sync decide whether the next backward reduces.
    assert model.sync_grads is False  # MegatronFSDP's default: deferred
    with model.sync():
        assert model.sync_grads is True
        with model.no_sync():
            assert model.sync_grads is False
        assert model.sync_grads is True
    model.set_model_auto_sync(True)
    assert model.sync_grads is True
    with model.no_sync():
        assert model.sync_grads is False
    assert model.sync_grads is True
    model.set_model_auto_sync(False)

    # Backward with deferred sync, then start_grad_sync / synchronize_gradient_reduce /
    # finish_grad_sync: replicated grads (0, 1) are reduced by start_grad_sync, sharded
    # ones (2, 3) were reduced in backward; neither is reduced twice.
    model.comm_stats(reset=True)
    _loss(model, *_data(0, rank)).backward()
    in_backward = model.comm_stats(reset=True)
    nb = sum(1 for g in model.buffer.groups if g.requires_grad)
    reductions = in_backward["all_reduce"]["calls"] + in_backward["reduce_scatter"]["calls"]
    assert reductions == (0 if strategy < 2 else nb)
    expected = _local_grad_mean(world)
    model.start_grad_sync()
    model.synchronize_gradient_reduce()
    after = model.comm_stats(reset=True)
    assert after["all_reduce"]["calls"] + after["reduce_scatter"]["calls"] == (
        nb if strategy < 2 else 0
    )
    assert all(s is GradState.REDUCED for s in model.buffer.grad_states())
    model.finish_grad_sync()
    again = model.comm_stats(reset=True)
    assert again["all_reduce"]["calls"] + again["reduce_scatter"]["calls"] == 0
    _check_grads(model, expected)

    # scale_gradients, zero_grad_buffer, attach_grad_to_optimizer_state.
    before = _grads(model)
    model.scale_gradients(2.0)
    for n, g in _grads(model).items():
        torch.testing.assert_close(g, 2.0 * before[n])
    opt.zero_grad(zero_grad_buffer=False)  # set_to_none: .grad dropped, buffers kept
    assert all(p.grad is None for p in model.parameters())
    model.attach_grad_to_optimizer_state()
    for n, g in _grads(model).items():
        torch.testing.assert_close(g, 2.0 * before[n])
    model.zero_grad_buffer()
    assert all(s is GradState.EMPTY for s in model.buffer.grad_states())
    assert all(torch.count_nonzero(g) == 0 for g in _grads(model).values())

    # install_optimized_model_weights: main weights changed by hand reach the compute
    # weights (gathered again for 1 and 2) only once installed.
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(0.01)
    model.comm_stats(reset=True)
    model.install_optimized_model_weights()
    sync = model.comm_stats(reset=True)["all_gather"]["calls"]
    assert sync == (nb if strategy in (1, 2) else 0)
    with torch.no_grad():
        torch.testing.assert_close(model(x), _ref_output(x, 0.01), rtol=1e-5, atol=1e-5)

    # broadcast_params: replicated buffers become rank 0's.
    if strategy < 3:
        if rank == 1:
            with torch.no_grad():
                for p in compute.values():
                    p.add_(1.0)
        model.broadcast_params()
        with torch.no_grad():
            torch.testing.assert_close(model(x), _ref_output(x, 0.01), rtol=1e-5, atol=1e-5)
    else:
        model.broadcast_params()  # nothing replicated to broadcast: a no-op
        assert model.comm_stats(reset=True)["broadcast"]["calls"] == 0

    # And training still works afterwards.
    _loss(model, *_data(1, rank)).backward()
    opt.step()
    opt.zero_grad()
    return True


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_megatron_fsdp_methods(strategy):
    assert run_distributed(_methods_body, WORLD, args=(strategy,)) == [True, True]


# ---- CUDA-only options on CPU ------------------------------------------------------------

# Every CUDA-only option, as ddp_config fields and as fully_shard's keywords.
CUDA_ONLY_FIELDS = (
    "nccl_ub",
    "disable_symmetric_registration",
    "keep_fp8_transpose_cache",
    "fp8_param_gather",
    "fsdp_manual_registration",
    "megatron_fsdp_cuda_graph_mode",
)
CUDA_ONLY_KEYWORDS = (
    "nccl_ub",
    "disable_symmetric_registration",
    "keep_fp8_transpose_cache",
    "cuda_graph_mode",
)
IGNORED_KEYWORDS = ("enable_fine_grained_param_gather",)


def _naming(caught, names):
    return [str(w.message) for w in caught if any(n in str(w.message) for n in names)]


def _options_body():
    """Before: one warning per option per process, and none at all for
    fp8_param_gather, fsdp_manual_registration and the cuda-graph flag of ddp_config."""
    from fsdp_hooks import DistributedDataParallel

    rank = dist.get_rank()
    mesh = fully_shard_model(_gpt(), fsdp_unit_modules=[Block]).get_distributed_index()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = DistributedDataParallelConfig(
            data_parallel_sharding_strategy=3, **dict.fromkeys(CUDA_ONLY_FIELDS, True)
        )
        first = MegatronFSDP(_gpt(), mesh, ddp_config=config, fsdp_unit_modules=[Block])
        # Wrapped again, through every entry point: nothing more is said.
        module = _gpt()
        model, opt = fully_shard(
            module, torch.optim.SGD(module.parameters(), lr=0.1), fsdp_unit_modules=[Block],
            **dict.fromkeys(CUDA_ONLY_KEYWORDS, True),
        )  # fmt: skip
        MegatronFSDP(_gpt(), mesh, ddp_config=config, fsdp_unit_modules=[Block])
        DistributedDataParallel(
            None, dict(config.__dict__, data_parallel_sharding_strategy="no_shard"), _gpt()
        )
    (message,) = _naming(caught, CUDA_ONLY_FIELDS)
    for name in CUDA_ONLY_FIELDS:
        assert f"{name}=True" in message, message
    assert "cuda_graph_mode" in message and "ignored on cpu" in message, message
    # Ignored on CPU, including nccl_ub's double buffers.
    for wrapper in (first, model):
        assert isinstance(wrapper.buffer.allocator, TemporaryBucketAllocator)
    _loss(model, *_data(0, rank)).backward()
    opt.step()

    # Options fsdp ignores on every device: one warning too, naming them.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            fully_shard_model(
                _gpt(), fsdp_unit_modules=[Block], **dict.fromkeys(IGNORED_KEYWORDS, True)
            )
    (message,) = _naming(caught, IGNORED_KEYWORDS)
    assert all(f"fully_shard's {n}" in message for n in IGNORED_KEYWORDS), message
    assert "has no effect in fsdp" in message, message

    # An option that would promise what fsdp does not do is refused, at every entry point
    # (before: accepted and ignored, with a warning).
    refused = []
    config = DistributedDataParallelConfig(fsdp_db_use_persist_buf_on_alloc_fail=True)
    for wrap in (
        lambda: fully_shard_model(
            _gpt(), fsdp_unit_modules=[Block], fsdp_db_use_persist_buf_on_alloc_fail=True
        ),
        lambda: MegatronFSDP(_gpt(), mesh, ddp_config=config, fsdp_unit_modules=[Block]),
        lambda: DistributedDataParallel(None, config, _gpt()),
    ):
        try:
            wrap()
        except ValueError as err:
            refused.append(str(err))
    assert len(refused) == 3, refused
    assert all("fsdp_db_use_persist_buf_on_alloc_fail=True is not supported" in m for m in refused)
    return True


def test_cuda_only_options_accepted_on_cpu_with_one_warning_in_all():
    assert run_distributed(_options_body, WORLD) == [True, True]


# ---- a released unit's parameters --------------------------------------------------------


def _released_body():
    """Between a ZeRO-3 unit's post-forward and its pre-backward its gathered bucket is
    freed: its modules then hold the DTensor shards, so reading them is safe (the
    compute views would read freed memory), and training is unchanged by it."""
    rank = dist.get_rank()
    runs = {}
    for read in (False, True):
        module = _gpt()
        model, opt = fully_shard(module, _sgd(module), fsdp_unit_modules=[Block])
        losses = []
        for step in range(STEPS):
            loss = _loss(model, *_data(step, rank))
            if read:
                block = model.module.blocks[0]
                for name, p in block.named_parameters():
                    assert isinstance(p, DTensor), name
                    assert torch.isfinite(p.to_local()).all(), name
                # Outside every unit: gathered until the end of backward, plain tensors.
                assert not isinstance(model.module.tok.weight, DTensor)
                assert torch.isfinite(model.module.tok.weight.sum())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs[read] = (losses, {n: p.to_local().clone() for n, p in model.state_dict().items()})
    assert runs[True][0] == runs[False][0]
    for name, value in runs[False][1].items():
        assert torch.equal(runs[True][1][name], value), name
    return True


def test_released_unit_params_are_dtensor_shards():
    assert run_distributed(_released_body, WORLD) == [True, True]


# ---- the default mesh, named after the arguments ----------------------------------------


def _default_mesh_body():
    """Without a device_mesh the default mesh takes its dim names from dp_shard_dim and
    tp_dim (a size-1 tp dim), as megatron_fsdp's does, and trains like any other."""
    rank, world = dist.get_rank(), dist.get_world_size()
    expected_grads = _local_grad_mean(world)
    cases = [
        ({}, ("dp_shard",), (world,)),
        ({"dp_shard_dim": "fsdp"}, ("fsdp",), (world,)),
        ({"dp_shard_dim": "fsdp", "tp_dim": "tp"}, ("fsdp", "tp"), (world, 1)),
        ({"tp_dim": "tensor"}, ("dp_shard", "tensor"), (world, 1)),
    ]
    for kwargs, names, shape in cases:
        module = _gpt()
        model, opt = fully_shard(module, _sgd(module), fsdp_unit_modules=[Block], **kwargs)
        index = model.get_distributed_index()
        mesh = index.device_mesh
        assert mesh.mesh_dim_names == names and tuple(mesh.shape) == shape, (kwargs, mesh)
        assert mesh.device_type == "cpu" and index.fsdp_size == world
        assert index.dp_shard_dim == names[0] and index.tp_dim == kwargs.get("tp_dim")
        _loss(model, *_data(0, rank)).backward()
        _check_grads(model, expected_grads)
        opt.step()
        opt.zero_grad()

    # The default mesh has no outer dim: hybrid-sharding arguments are dropped with a
    # warning (megatron_fsdp drops them silently), and training is plain FSDP.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fully_shard_model(
            _gpt(),
            dp_outer_dim="outer",
            outer_dp_sharding_strategy="optim",
            fsdp_unit_modules=[Block],
        )
    messages = [str(w.message) for w in caught]
    for name in ("dp_outer_dim", "outer_dp_sharding_strategy"):
        assert sum(m.startswith(f"{name} is ignored without a device_mesh") for m in messages) == 1
    assert model.get_distributed_index().dp_outer_dim is None
    assert model.get_distributed_index().device_mesh.mesh_dim_names == ("dp_shard",)

    with pytest.raises(ValueError, match=r"dp_shard_dim and tp_dim name the same dim \('x'\)"):
        fully_shard_model(_gpt(), dp_shard_dim="x", tp_dim="x")
    return True


def test_default_mesh_is_named_after_dp_shard_dim_and_tp_dim():
    assert run_distributed(_default_mesh_body, WORLD) == [True, True]


def test_fully_shard_needs_an_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialized"):
        fully_shard_model(nn.Linear(2, 2))
