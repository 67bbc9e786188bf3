"""``fsdp_no_shard`` under ZeRO-3: a marked FSDP unit gets no hooks, is never
all-gathered, and its gradients are still all-reduced (training matches one process).
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate
from torch.nn import functional as F

from fsdp_buffers import fsdp_no_shard
from fsdp_hooks import fully_shard
from fsdp_mesh.testing import gather_rows, run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

CFG = GPTConfig(vocab_size=40, max_seq_len=8, dim=16, n_heads=2, n_layers=3)
ROWS = 2  # per rank
WORLD = 2
STEPS = 3
FEATS = 6


class Encoder(nn.Module):
    """A frozen feature encoder, as a vision tower in a VLM."""

    def __init__(self, dim):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATS, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, feats):
        return self.net(feats)


class EncoderGPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.encoder = Encoder(cfg.dim)
        self.gpt = GPT(cfg)

    def forward(self, idx, feats):
        g = self.gpt
        positions = torch.arange(idx.shape[1])
        x = g.tok(idx) + g.pos(positions) + self.encoder(feats)
        for block in g.blocks:
            x = block(x)
        return g.head(g.ln_f(x))


def _build(kind):
    torch.manual_seed(0)
    if kind == "block":
        model = GPT(CFG)
        fsdp_no_shard(model.blocks[1])
        return model, model.blocks[1]
    model = EncoderGPT(CFG)
    model.encoder.requires_grad_(False)
    fsdp_no_shard(model.encoder)
    return model, model.encoder


def _batch(step, kind, world=WORLD):
    x, y = token_batch(step, ROWS * world, CFG.max_seq_len, CFG.vocab_size)
    g = torch.Generator().manual_seed(1000 + step)
    feats = torch.randn(ROWS * world, CFG.max_seq_len, FEATS, generator=g)
    return (x, feats) if kind == "encoder" else (x,), y


def _optimizer(module):
    # SGD, not Adam: the attention key bias has a gradient that is zero up to rounding,
    # which Adam's normalization would turn into visible noise.
    return torch.optim.SGD(
        [p for p in module.parameters() if p.requires_grad], lr=0.2, momentum=0.9
    )


def _loss(model, inputs, y):
    return F.cross_entropy(model(*inputs).flatten(0, 1), y.flatten())


def _reference(kind):
    """One process, the whole global batch (WORLD ranks' rows)."""
    model, _ = _build(kind)
    opt = _optimizer(model)
    for step in range(STEPS):
        _loss(model, *_batch(step, kind)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _padded(model, gid):
    return model.buffer.buckets[gid].layout.total_numel


def _full(model, name, p):
    """The whole parameter from every rank's rows (the layout's rows are uneven, not
    ``torch.chunk``'s, so ``DTensor.full_tensor`` does not apply)."""
    local = p.to_local().detach()
    if isinstance(p.placements[0], Replicate):
        return local
    return gather_rows(local, model.buffer.views.local_rows(name))


def _body(kind):
    rank = dist.get_rank()
    module, marked = _build(kind)
    units = [Block, Encoder] if kind == "encoder" else [Block]
    opt = _optimizer(module)
    model, opt = fully_shard(module, opt, fsdp_unit_modules=units, zero_dp_strategy=3)
    buffer = model.buffer

    # The marked unit: only its two state-tracking hooks, none on its submodules (no
    # per-layer dispatch; that they gather nothing is counted below); every other unit
    # has its gathering pre/post hooks.
    marked_unit = next(u for u in model.hooks.units if u.module is marked)
    assert len(marked_unit.handles) == 2
    assert len(marked._forward_pre_hooks) == 1 and len(marked._forward_hooks) == 1
    for sub in list(marked.modules())[1:]:
        assert not sub._forward_pre_hooks and not sub._forward_hooks, sub
    others = [u for u in model.hooks.units if u is not marked_unit]
    assert others and all(len(u.handles) == 2 for u in others)
    assert all(len(u.module._forward_pre_hooks) == 1 for u in others)

    # Its bucket is replicated: full parameters on every rank, never gathered.
    marked_gids = set(marked_unit.groups)
    for gid in marked_gids:
        assert buffer.groups[gid].fsdp_no_shard
        assert not buffer.groups[gid].model_weight_buffer.is_data_distributed
    for name, p in model.module.named_parameters():
        if name.startswith(("blocks.1.", "encoder.")):
            assert isinstance(p.placements[0], Replicate), name
            assert p.to_local().shape == p.shape, name

    # Formula (no_shard units excluded): every sharded unit bucket is gathered twice
    # (forward, backward), every sharded bucket outside units once (root pre-forward).
    sharded = [g for g in range(buffer.num_buckets) if g not in marked_gids]
    assert all(buffer.groups[g].model_weight_buffer.is_data_distributed for g in sharded)
    unit_b = [g for g in sharded if buffer.groups[g].fsdp_unit_id is not None]
    root_b = [g for g in sharded if buffer.groups[g].fsdp_unit_id is None]
    expected_gather = 2 * sum(_padded(model, g) for g in unit_b) + sum(
        _padded(model, g) for g in root_b
    )
    trainable = [g for g in range(buffer.num_buckets) if buffer.groups[g].requires_grad]
    expected_rs = sum(_padded(model, g) for g in trainable if g not in marked_gids)
    expected_ar = sum(_padded(model, g) for g in trainable if g in marked_gids)
    if kind == "encoder":
        assert expected_ar == 0  # frozen: nothing to reduce

    model.comm_stats(reset=True)
    for step in range(STEPS):
        inputs, y = _batch(step, kind)
        inputs = tuple(t[ROWS * rank : ROWS * (rank + 1)] for t in inputs)
        _loss(model, inputs, y[ROWS * rank : ROWS * (rank + 1)]).backward()
        opt.step()
        opt.zero_grad()
        stats = model.comm_stats(reset=True)
        ag, rs, ar = stats["all_gather"], stats["reduce_scatter"], stats["all_reduce"]
        assert ag["numel"] == expected_gather, (step, ag, expected_gather)
        assert ag["calls"] == 2 * len(unit_b) + len(root_b)
        assert rs["numel"] == expected_rs and rs["calls"] == len(trainable) - len(
            [g for g in trainable if g in marked_gids]
        )
        assert ar["numel"] == expected_ar
        assert ar["calls"] == len([g for g in trainable if g in marked_gids])

    params = {n: _full(model, n, p) for n, p in model.module.named_parameters()}
    marked_numel = sum(p.numel() for p in marked.parameters())
    return params, expected_gather, marked_numel, [_padded(model, g) for g in marked_gids]


def _check(kind):
    results = run_distributed(_body, WORLD, args=(kind,))
    ref = _reference(kind)
    for params, *_ in results:
        assert set(params) == set(ref)
        for name, expected in ref.items():
            torch.testing.assert_close(
                params[name], expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )
    return results[0]


def test_no_shard_block_unit_is_never_gathered_and_trains_like_one_process():
    _params, _gathered, marked_numel, marked_padded = _check("block")
    assert marked_numel > 0 and sum(marked_padded) >= marked_numel


def test_no_shard_frozen_encoder_unit_is_never_gathered():
    params, _gathered, marked_numel, _ = _check("encoder")
    # Frozen: the encoder's weights did not move.
    module, _ = _build("encoder")
    for name, p in module.named_parameters():
        if name.startswith("encoder."):
            torch.testing.assert_close(params[name], p.detach())
    assert marked_numel > 0
