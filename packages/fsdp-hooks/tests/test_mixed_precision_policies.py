"""Every ``MixedPrecisionPolicy`` combination Megatron-FSDP 0.6.1 accepts trains, with
parity against one process that rounds at the same points, under ZeRO-0/1/2/3 and HSDP.

Megatron-FSDP's fields are independent: ``main_params_dtype`` (the optimizer's weights;
``None``: the model's own), ``main_grads_dtype`` (where gradients accumulate) and
``grad_comm_dtype`` (what the reduction sends). Before the fix any main-grad dtype other
than the main weights' crashed at the first gradient attachment ("attempting to assign
a gradient with dtype ... to a tensor with grad_dtype ..."): fp32 weights with bf16
gradients (Megatron-Core's ``--grad-reduce-in-bf16``), ``main_params_dtype=None`` on a
bf16 model (fp32 gradients by our rule), fp64 weights with fp32 gradients. Now, as in
Megatron-FSDP (``update_main_grads``), the optimizer's gradient is the main gradient
cast to the main weights' dtype.

The reference (one process, same data) emulates each rounding of the pipeline: rank r's
local gradient g_r (autograd, in the model's dtype) is accumulated into the main-grad
dtype G where gradients are replicated (ZeRO-0/1: the persistent main-grad buffer is
what is reduced; under ZeRO-2/3 autograd's ``.grad`` is packed straight into the
reduction, so there is no rounding into G before it), cast to the communication dtype C
and scaled there by 1/N, summed in C (over
the shard group, then, HSDP, landed in G and summed in C over the outer group), landed
in G, and cast to the main-weight dtype M for AdamW, which steps the M main weights;
the model's weights are those rounded to the model's dtype. Each sum here has two terms,
so one rounding whatever the order. What remains between fsdp and the reference is
the order of fp32 operations (none measured: the ranks run the same kernels on the same
slices), so the tolerance is the fp32 one, 1e-5 relative, for every combination; a
wrong rounding point (e.g. summing in G instead of C, or not rounding into G) moves
results by a unit of bf16 (2^-8 relative in a gradient, ~1e-4 in a weight after
AdamW) and fails it, which ``test_an_ignored_grads_dtype_fails_the_tolerance`` checks.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_buffers import MixedPrecisionPolicy
from fsdp_hooks import fully_shard
from fsdp_mesh import build_device_mesh
from fsdp_mesh.testing import harness_device, harness_device_type, run_distributed

# Runs on CUDA + NCCL under --fsdp-device cuda (root conftest.py).
pytestmark = pytest.mark.cuda

bf16, fp16, fp32, fp64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
STEPS = 4
ROWS = 4  # per rank
DIM = 12
LR = 1e-2
RTOL = 1e-5

# name -> (model dtype, policy)
CASES: dict[str, tuple[torch.dtype, MixedPrecisionPolicy]] = {
    "fp32_main_bf16_grads": (fp32, MixedPrecisionPolicy(fp32, bf16)),
    "fp32_main_bf16_grads_fp32_comm": (fp32, MixedPrecisionPolicy(fp32, bf16, fp32)),
    "fp32_main_fp32_grads_bf16_comm": (fp32, MixedPrecisionPolicy(fp32, fp32, bf16)),
    "fp32_main_fp16_grads": (fp32, MixedPrecisionPolicy(fp32, fp16)),
    "bf16_model_main_none": (bf16, MixedPrecisionPolicy(None)),
    "bf16_model_main_none_bf16_grads": (bf16, MixedPrecisionPolicy(None, bf16)),
    "bf16_model_fp32_main_bf16_grads": (bf16, MixedPrecisionPolicy(fp32, bf16)),
    "bf16_model_fp32_main_fp32_grads_bf16_comm": (bf16, MixedPrecisionPolicy(fp32, fp32, bf16)),
    "fp64_model_fp32_grads": (fp64, MixedPrecisionPolicy(fp32, fp32)),
    # FSDP2's spelling on an fp32 model: the library makes the bf16 compute copy.
    "fsdp2_bf16_params_fp32_reduce": (
        fp32,
        MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32, output_dtype=fp32),
    ),
    "fsdp2_bf16_params_bf16_reduce": (
        fp32,
        MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16),
    ),
    "fsdp2_bf16_params_main_none": (fp32, MixedPrecisionPolicy(None, param_dtype=bf16)),
}
# (name, world, zero strategy, outer sharding or None)
LAYOUTS = [(f"zero{s}", 2, s, None) for s in (0, 1, 2, 3)] + [
    ("hsdp", 4, 3, "no_shard"),
    ("hsdp_z1", 4, 1, "no_shard"),
    ("hsdp_full", 4, 3, "optim"),
]


class Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def build(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Layer(DIM), Layer(DIM), nn.Linear(DIM, 3)).to(dtype)


def batch(
    step: int, world: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drawn on the CPU, then moved to ``device`` (None: ``harness_device()``)."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(world * ROWS, DIM, generator=g), torch.randn(world * ROWS, 3, generator=g)
    device = harness_device() if device is None else device
    return x.to(device), y.to(device)


def loss_of(model: nn.Module, dtype: torch.dtype, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x.to(dtype))
    return (out.float() - y).pow(2).mean()


def resolved(model_dtype: torch.dtype, policy: MixedPrecisionPolicy) -> tuple[torch.dtype, ...]:
    """(main weights, main grads, communication, compute) dtypes."""
    return (
        policy.main_params_dtype_for(model_dtype),
        policy.main_grads_dtype_for(model_dtype),
        policy.grad_comm_dtype_for(model_dtype),
        policy.compute_dtype_for(model_dtype),
    )


# ---- the reference ----------------------------------------------------------------------


def reduce_like_fsdp(
    local: list[torch.Tensor], g: torch.dtype, c: torch.dtype, shard: int, staged: bool
) -> torch.Tensor:
    """The reduced main gradient (in G) from the ranks' local gradients, rounded where
    fsdp rounds; ``staged``: rounded into G before the reduction (replicated gradients).
    Ranks are row-major over (outer, shard): shard groups are consecutive."""
    n = len(local)
    sends = [((t.to(g) if staged else t).to(c)).mul_(1.0 / n) for t in local]
    inner = [sum(sends[i + 1 : i + shard], sends[i]).to(g) for i in range(0, n, shard)]
    if len(inner) == 1:
        return inner[0]
    outer = [t.to(c) for t in inner]
    return sum(outer[1:], outer[0]).to(g)


@functools.cache  # shared by the layouts with the same world and shard sizes
def reference(
    case: str, world: int, shard: int, staged: bool, grads_in_main: bool = False
) -> dict[str, Any]:
    """One process: the ranks' slices one after another, their gradients reduced by
    ``reduce_like_fsdp``, AdamW on main weights in M. ``grads_in_main`` (to check that
    the test can fail) ignores G and C: everything in M."""
    model_dtype, policy = CASES[case]
    m, g, c, compute = resolved(model_dtype, policy)
    if grads_in_main:
        g = c = m
    # On the device type the ranks train on, so that both run the same kernels (CPU and
    # CUDA ones round differently, and RTOL leaves room for fp32 ordering only).
    device = torch.device(harness_device_type())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks: CPU kernels' reduction order depends on it
    try:
        # Main weights from the model's own values; the compute model is their rounding
        # to the compute dtype, made anew from the main weights after every step.
        model = build(model_dtype).to(device)
        main = [p.detach().to(m).clone().requires_grad_() for p in model.parameters()]
        model = model.to(compute)
        params = list(model.parameters())
        opt = torch.optim.AdamW(main, lr=LR)
        losses = []
        for step in range(STEPS):
            x, y = batch(step, world, device)
            per_rank: list[list[torch.Tensor]] = []
            total = 0.0
            for r in range(world):
                rows = slice(r * ROWS, (r + 1) * ROWS)
                loss = loss_of(model, compute, x[rows], y[rows])
                grads = torch.autograd.grad(loss, params)
                per_rank.append(list(grads))
                total += loss.item()
            losses.append(total / world)
            for i, w in enumerate(main):
                w.grad = reduce_like_fsdp([pr[i] for pr in per_rank], g, c, shard, staged).to(m)
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for p, w in zip(params, main, strict=True):
                    p.copy_(w)
        # On the CPU, where the ranks' results come back.
        return {"losses": losses, "params": [w.detach().cpu().clone() for w in main]}
    finally:
        torch.set_num_threads(threads)


# ---- on the ranks -----------------------------------------------------------------------


def _full_main_weights(model) -> list[torch.Tensor]:
    """On the CPU: all_gather_object would unpickle another rank's CUDA tensor on that
    rank's GPU, and torch.cat refuses tensors on two devices."""
    out = []
    for p in model.parameters():
        local = p.to_local().detach().cpu().clone()
        if p.placements[0].is_replicate():
            out.append(local)
            continue
        parts: list[Any] = [None] * dist.get_world_size(p.device_mesh.get_group())
        dist.all_gather_object(parts, local, group=p.device_mesh.get_group())
        out.append(torch.cat(parts))
    return out


def _train_layouts(layouts: list[tuple[str, int, int, str | None]]) -> dict[str, Any]:
    return {name: _train(world, strategy, outer) for name, world, strategy, outer in layouts}


def _train(world: int, strategy: int, outer: str | None) -> dict[str, Any]:
    rank = dist.get_rank()
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    mesh: dict[str, Any] = {}
    if outer is not None:
        mesh = {
            "device_mesh": build_device_mesh(dp_outer=2, dp_shard=2).device_mesh,
            "dp_shard_dim": "dp_shard",
            "dp_outer_dim": "dp_outer",
            "outer_dp_sharding_strategy": outer,
        }
    out: dict[str, Any] = {}
    for case, (model_dtype, policy) in CASES.items():
        module = build(model_dtype)
        original = [p.detach().clone() for p in module.parameters()]
        model, opt = fully_shard(
            module,
            torch.optim.AdamW(module.parameters(), lr=LR),
            fsdp_unit_modules=[Layer],
            zero_dp_strategy=strategy,
            mixed_precision_policy=policy,
            **mesh,
        )
        initial = _full_main_weights(model)
        losses = []
        dtypes = set()
        for step in range(STEPS):
            x, y = batch(step, world)
            # In the model's dtype: under param_dtype the wrapper casts the inputs.
            loss = loss_of(model, model_dtype, x[rows], y[rows])
            loss.backward()
            dtypes |= {(p.dtype, p.grad.dtype) for p in model.parameters() if p.grad is not None}
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
        out[case] = {
            "losses": losses,
            "params": _full_main_weights(model),
            "dtypes": dtypes,
            "initial_exact": all(
                torch.equal(a, b.to(a.dtype)) for a, b in zip(initial, original, strict=True)
            ),
            "state_dict": {k: v.full_tensor() for k, v in model.state_dict().items()},
            "names": [n for n, _ in module.named_parameters()],
        }
    return out


@pytest.fixture(scope="module")
def trained() -> dict[str, tuple[int, int, dict[str, Any]]]:
    results = {}
    for world in sorted({w for _n, w, _s, _o in LAYOUTS}):
        layouts = [layout for layout in LAYOUTS if layout[1] == world]
        per_rank = run_distributed(_train_layouts, world, args=(layouts,), timeout=240)
        for name, _w, _s, outer in layouts:
            results[name] = (world, 2 if outer else world, [r[name] for r in per_rank])
    return results


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    scale = want.abs().max().clamp_min(1e-6)
    return bool(((got.to(want.dtype) - want).abs().max() / scale) <= RTOL)


@pytest.mark.parametrize("layout", [name for name, *_ in LAYOUTS])
def test_every_policy_matches_one_process_rounding_the_same_way(trained, layout) -> None:
    world, shard, per_rank = trained[layout]
    (strategy,) = [s for name, _w, s, _o in LAYOUTS if name == layout]
    for case, (model_dtype, policy) in CASES.items():
        ref = reference(case, world, shard, staged=strategy < 2)
        m = policy.main_params_dtype_for(model_dtype)
        for rank, result in enumerate(per_rank):
            got = result[case]
            # The optimizer steps M weights with M gradients (cast from the main grads).
            assert got["dtypes"] == {(m, m)}, (layout, case, rank, got["dtypes"])
            # Main weights start as the model's own values (not a compute-dtype rounding)
            # and the state dict holds them.
            assert got["initial_exact"], (layout, case, rank)
            sd = got["state_dict"]
            for name, a in zip(got["names"], got["params"], strict=True):
                assert sd[name].dtype == m and torch.equal(sd[name], a), (layout, case, name)
            for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
                assert abs(a - b) <= RTOL * abs(b), (layout, case, rank, step, a, b)
            for i, (a, b) in enumerate(zip(got["params"], ref["params"], strict=True)):
                assert a.dtype == m, (layout, case, i, a.dtype)
                assert _close(a, b), (layout, case, rank, i, (a - b).abs().max().item())


def test_an_ignored_grads_dtype_fails_the_tolerance(trained) -> None:
    """Gradients kept in fp32 where the policy asks for bf16 give other weights than
    fsdp's beyond the tolerance: the parity test would catch a field that is ignored."""
    world, shard, per_rank = trained["zero3"]
    case = "fp32_main_bf16_grads"
    wrong = reference(case, world, shard, staged=False, grads_in_main=True)
    got = per_rank[0][case]["params"]
    assert not all(_close(a, b) for a, b in zip(got, wrong["params"], strict=True))


# ---- checkpoints under FSDP2's param_dtype ---------------------------------------------------


def _ckpt_job(directory: str) -> dict[str, Any]:
    """fp32 model, bf16 compute copy: 2 steps, save, load into a model built from another
    seed, 2 more steps; and 4 uninterrupted steps."""
    from fsdp_ckpt import load_checkpoint, save_checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    policy = MixedPrecisionPolicy(param_dtype=bf16)

    def wrap(seed: int):
        torch.manual_seed(seed)
        module = nn.Sequential(Layer(DIM), Layer(DIM), nn.Linear(DIM, 3))
        return fully_shard(
            module,
            torch.optim.AdamW(module.parameters(), lr=LR),
            fsdp_unit_modules=[Layer],
            mixed_precision_policy=policy,
        )

    def train(model, opt, start: int, stop: int) -> list[float]:
        losses = []
        for step in range(start, stop):
            x, y = batch(step, world)
            loss = loss_of(model, fp32, x[rows], y[rows])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    model, opt = wrap(0)
    straight = train(model, opt, 0, 4)
    model, opt = wrap(0)
    first = train(model, opt, 0, 2)
    saved = _full_main_weights(model)
    save_checkpoint(directory, model, opt)
    model, opt = wrap(1)
    load_checkpoint(directory, model, opt)
    loaded = _full_main_weights(model)
    resumed = first + train(model, opt, 2, 4)
    return {
        "straight": straight,
        "resumed": resumed,
        "loaded_exact": all(torch.equal(a, b) for a, b in zip(saved, loaded, strict=True)),
        "dtypes": {t.dtype for t in loaded},
        "not_bf16": any(not torch.equal(t, t.to(bf16).to(fp32)) for t in loaded),
    }


def test_checkpoint_under_param_dtype_keeps_fp32_main_weights(tmp_path) -> None:
    """A checkpoint of an fp32 model trained with a bf16 compute copy holds the fp32
    main weights: loaded into a model built from another seed they are equal bit for
    bit (not their bf16 rounding), and training resumes with the losses of an
    uninterrupted run (the compute copy is remade from them)."""
    for rank, r in enumerate(run_distributed(_ckpt_job, 2, args=(str(tmp_path),), timeout=120)):
        assert r["dtypes"] == {fp32}, (rank, r["dtypes"])
        assert r["not_bf16"], rank
        assert r["loaded_exact"], rank
        assert r["resumed"] == r["straight"], (rank, r["resumed"], r["straight"])


# ---- what param_dtype refuses ----------------------------------------------------------------


def _error_of(fn) -> str:
    try:
        fn()
    except (NotImplementedError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _refusals() -> dict[str, str]:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    policy = MixedPrecisionPolicy(param_dtype=bf16)
    out = {}
    mesh = build_device_mesh(dp_shard=2, tp=2).device_mesh
    module = build(fp32)
    parallelize_module(module, mesh["tp"], {"0.lin": ColwiseParallel()})
    out["tp"] = _error_of(
        lambda: fully_shard(
            module,
            torch.optim.AdamW(module.parameters(), lr=LR),
            device_mesh=mesh,
            dp_shard_dim="dp_shard",
            tp_dim="tp",
            fsdp_unit_modules=[Layer],
            mixed_precision_policy=policy,
        )
    )
    # ZeRO-1 over the 4 ranks: sharded fp32 main weights would be re-derived from the
    # bf16 compute copy.
    plain = build(fp32)
    model, _opt = fully_shard(
        plain,
        torch.optim.AdamW(plain.parameters(), lr=LR),
        fsdp_unit_modules=[Layer],
        zero_dp_strategy=1,
        mixed_precision_policy=policy,
    )
    out["broadcast"] = _error_of(lambda: model.buffer.broadcast_params())
    # Fully-sharded HSDP: the fine fp32 main weights would come from the compute shard.
    plain = build(fp32)
    model, _opt = fully_shard(
        plain,
        torch.optim.AdamW(plain.parameters(), lr=LR),
        device_mesh=build_device_mesh(dp_outer=2, dp_shard=2).device_mesh,
        dp_shard_dim="dp_shard",
        dp_outer_dim="dp_outer",
        outer_dp_sharding_strategy="optim",
        fsdp_unit_modules=[Layer],
        mixed_precision_policy=policy,
    )
    out["broadcast_hsdp_full"] = _error_of(lambda: model.buffer.broadcast_params())
    return out


def test_param_dtype_refusals_on_every_rank() -> None:
    """Not silently wrong: tensor-parallel (DTensor) parameters under a compute copy in
    another dtype, and ``broadcast_params`` where it would round the fp32 main weights
    through the bf16 copy (ZeRO-1, fully-sharded HSDP), raise on every rank."""
    for rank, r in enumerate(run_distributed(_refusals, 4, timeout=120)):
        assert r["tp"].startswith("NotImplementedError") and "over tensor-parallel" in r["tp"], (
            rank,
            r,
        )
        assert r["broadcast"].startswith("NotImplementedError"), (rank, r)
        assert "broadcast_params" in r["broadcast"], (rank, r)
        assert r["broadcast_hsdp_full"].startswith("NotImplementedError"), (rank, r)
