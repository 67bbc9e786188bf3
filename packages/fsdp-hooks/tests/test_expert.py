"""Expert parallelism: a toy mixture-of-experts whose experts are split across 2
expert-parallel ranks (world size 4: dense shard group of 4, expert mesh of 2 expert
data-parallel x 2 expert-parallel ranks) trains like one process holding every expert.

Expert parameters are found by the default name rule (``experts.``), get their own
buckets sharded over the expert mesh's ``dp_shard`` dim, and their gradients are
scaled by 1/(dense data-parallel size); SGD (not Adam, which would hide a wrong
scale) must reproduce the single-process losses and parameters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from fsdp_hooks import default_is_expert_param, fully_shard, mark_expert_params
from fsdp_hooks.features.experts import resolve_is_expert_param
from fsdp_mesh import build_device_mesh
from fsdp_mesh.testing import run_distributed

WORLD = 4
EP = 2
N_EXPERTS = 4
DIM_IN, DIM, DIM_OUT, HIDDEN = 6, 8, 3, 16
TOKENS = 4  # per rank per step
STEPS = 3
LR = 0.2
MAX_NORM = 0.3


class _GatherTokens(torch.autograd.Function):
    """Concatenate every expert-parallel rank's tokens (dim 0)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ctx.rank, ctx.n = dist.get_rank(group), dist.get_world_size(group)
        out = torch.empty((ctx.n * x.shape[0], *x.shape[1:]), dtype=x.dtype)
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.n)[ctx.rank], None


class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.w2(torch.tanh(self.w1(x)))


class MoE(nn.Module):
    """Top-1 routing. With an expert-parallel group, this rank holds the experts
    ``expert_ids``; tokens are gathered from the group, each rank applies its own
    experts, and the partial outputs are summed back over the group."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, N_EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(N_EXPERTS))
        self.expert_ids = list(range(N_EXPERTS))
        self.group = None
        self.experts_attr = "experts"  # "local_experts": a name the default rule misses

    def forward(self, h):
        probs = F.softmax(self.router(h), dim=-1)
        gate, top = probs.max(dim=-1)
        if self.group is not None:
            n, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
            both = _GatherTokens.apply(torch.cat([h, gate[:, None]], dim=1), self.group)
            h_all, gate_all = both[:, :-1], both[:, -1]
            top_all = torch.empty(n * top.numel(), dtype=top.dtype)
            dist.all_gather_into_tensor(top_all, top, group=self.group)
        else:
            h_all, gate_all, top_all = h, gate, top
        y = torch.zeros_like(h_all)
        experts = getattr(self, self.experts_attr)
        for eid, expert in zip(self.expert_ids, experts, strict=True):
            mask = (top_all == eid).to(h_all.dtype)[:, None]
            y = y + mask * gate_all[:, None] * expert(h_all)
        if self.group is not None:
            y = _SumOverRanks.apply(y, self.group).chunk(n)[rank]
        return y


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM_IN, DIM)
        self.moe = MoE()
        self.out = nn.Linear(DIM, DIM_OUT)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.out(h + self.moe(h))


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(WORLD * TOKENS, DIM_IN, generator=g)
    return x, torch.randn(WORLD * TOKENS, DIM_OUT, generator=g)


def _reference(clip=False):
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = F.mse_loss(net(x), y)
        loss.backward()
        if clip:
            grads = [p.grad for p in net.parameters()]
            norms.append(torch.nn.utils.get_total_norm(grads, float("inf")).item())
            norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    return (losses, norms, params) if clip else (losses, params)


def _global_name(name, ids):
    parts = name.split(".")
    if parts[:2] in (["moe", "experts"], ["moe", "local_experts"]):
        parts[2] = str(ids[int(parts[2])])
    return ".".join(parts)


def _train(strategy, own_rule=False, marker=False, clip=False):
    """``own_rule``: the expert parameters are named by an ``is_expert_param`` callable
    passed to ``fully_shard`` instead of the default rule; it must be asked about
    every parameter and decide alone. ``marker``: the experts live under a name the
    default rule does not know and are marked with ``mark_expert_params``. ``clip``:
    ``model.clip_grad_norm_`` each step (its norms are returned too)."""
    rank = dist.get_rank()
    meshes = build_device_mesh(dp_shard=WORLD, expert_parallel=EP)
    ep_mesh = meshes.expt_device_mesh["ep"]
    ep_rank = ep_mesh.get_local_rank()
    torch.manual_seed(0)
    net = Net()
    local = N_EXPERTS // EP
    ids = list(range(ep_rank * local, (ep_rank + 1) * local))
    net.moe.experts = nn.ModuleList(net.moe.experts[i] for i in ids)
    net.moe.expert_ids = ids
    net.moe.group = ep_mesh.get_group()
    if marker:
        net.moe.local_experts = net.moe.experts
        del net.moe.experts
        net.moe.experts_attr = "local_experts"
        mark_expert_params(net.moe.local_experts.parameters())
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    asked = set()
    extra = {}
    if own_rule:

        def is_expert_param(name, param):
            asked.add(name)
            return name.startswith("moe.experts.")

        extra["is_expert_param"] = is_expert_param
    model, opt = fully_shard(
        net,
        opt,
        **meshes.fsdp_kwargs(),
        fsdp_unit_modules=[MoE],
        zero_dp_strategy=strategy,
        **extra,
    )
    if own_rule:
        assert asked == {n for n, _ in model.module.named_parameters()}, asked
    buf = model.buffer
    expert_groups = [g for g, grp in enumerate(buf.groups) if grp.is_expert_param]
    assert expert_groups and all(buf.buckets[g].shard.size == WORLD // EP for g in expert_groups)
    prefix = "moe.local_experts." if marker else "moe.experts."
    expert_names = {n for g in expert_groups for n in buf.groups[g].names}
    assert expert_names == {n for n, _ in model.module.named_parameters() if n.startswith(prefix)}
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _batch(step)
        xb, yb = x[rank * TOKENS : (rank + 1) * TOKENS], y[rank * TOKENS : (rank + 1) * TOKENS]
        loss = F.mse_loss(model(xb), yb)
        loss.backward()
        if clip:
            norms.append(model.clip_grad_norm_(float("inf"), norm_type=float("inf")).item())
            norms.append(model.clip_grad_norm_(MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / WORLD)
    params = {_global_name(name, ids): t for name, t in buf.views.full_parameters().items()}
    # Local expert names collide across expert-parallel ranks: state dicts use global
    # ones (checkpoints: test_expert_checkpoint.py).
    assert set(model.state_dict()) == set(params)
    params = {n.replace(".local_experts.", ".experts."): p for n, p in params.items()}
    return (losses, norms, params) if clip else (losses, params)


def _train_all(strategies):
    out = {s: _train(s) for s in strategies}
    out["own_rule"] = _train(3, own_rule=True)
    out["marker"] = _train(3, marker=True)
    return out


def test_expert_parallel_parity():
    ref_losses, ref_params = _reference()
    results = run_distributed(_train_all, WORLD, args=((1, 3),), timeout=120)
    for strategy in (1, 3, "own_rule", "marker"):
        merged = {}
        for losses, params in (r[strategy] for r in results):
            torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
            merged.update(params)
        assert set(merged) == set(ref_params)
        for name, ref in ref_params.items():
            torch.testing.assert_close(
                merged[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )


def _train_clipped():
    return {s: _train(s, clip=True) for s in (1, 3)}


def test_clip_grad_norm_across_expert_parallel_ranks():
    """``torch.nn.utils.clip_grad_norm_`` cannot mix the dense and expert meshes (nor
    see other ranks' experts); ``model.clip_grad_norm_`` gives the one-process norms,
    2 and inf, and clips like it (MAX_NORM is below every step's norm)."""
    ref_losses, ref_norms, ref_params = _reference(clip=True)
    assert min(ref_norms[1::2]) > MAX_NORM  # clipping acts on every step
    results = run_distributed(_train_clipped, WORLD, timeout=120)
    for strategy in (1, 3):
        merged = {}
        for losses, norms, params in (r[strategy] for r in results):
            torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
            torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
            merged.update(params)
        for name, ref in ref_params.items():
            torch.testing.assert_close(
                merged[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )


def test_expert_param_rules():
    p = nn.Parameter(torch.zeros(1))
    assert default_is_expert_param("layers.0.mlp.experts.3.w1.weight", p)
    assert default_is_expert_param("experts.0.weight", p)
    assert not default_is_expert_param("layers.0.mlp.shared_experts_gate.weight", p)
    assert not default_is_expert_param("router.weight", p)
    q = nn.Parameter(torch.zeros(1))
    mark_expert_params([q])
    assert default_is_expert_param("router.weight", q)
    r = nn.Parameter(torch.zeros(1))
    r.allreduce = False  # Megatron-Core's marker
    assert default_is_expert_param("anything", r)
    rule = resolve_is_expert_param(r"\.moe_mlp\.", has_expert_mesh=True)
    assert rule("a.moe_mlp.w", p) and not rule("a.experts.w", p) and rule("x", q)
    assert resolve_is_expert_param(None, has_expert_mesh=False) is None
    assert resolve_is_expert_param(None, has_expert_mesh=True) is default_is_expert_param
