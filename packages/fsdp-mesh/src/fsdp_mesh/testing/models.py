"""Small models for tests, examples and benchmarks (plain torch; the harness only says
where a batch goes).

``GPT`` is a decoder-only transformer: token and position embeddings, ``Block``s
(pre-norm attention and MLP) and an output head tied to the token embedding. The
``Block`` class is the natural FSDP unit. ``FusedWeightGradLinear`` is the weight
gradient path of Megatron-Core's gradient-accumulation fusion (and Transformer
Engine's fused wgrad), for tests of the ``main_grad`` protocol.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fsdp_mesh.testing._runner import harness_device

__all__ = ["GPT", "Block", "FusedWeightGradLinear", "GPTConfig", "token_batch"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 64
    max_seq_len: int = 16
    dim: int = 32
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = True


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or GPTConfig()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def token_batch(
    step: int,
    batch: int,
    seq_len: int,
    vocab_size: int,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch of (inputs, next-token targets) for ``step``: the same on
    every rank, so rank r can take rows [r*b, (r+1)*b) and a reference the whole.

    Drawn on the CPU (the same numbers everywhere), then moved to ``device``; None
    means the rank's device inside a process group (its GPU under NCCL), else the CPU."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab_size, (batch, seq_len + 1), generator=g)
    tokens = tokens.to(harness_device() if device is None else device)
    return tokens[:, :-1], tokens[:, 1:]


class FusedWeightGradLinear(torch.autograd.Function):
    """``x @ weight.t()`` whose backward adds the weight gradient straight into
    ``weight.main_grad`` and sets ``weight.grad_added_to_main_grad``; autograd gets a
    zero weight gradient. ``main_grad`` must exist when backward reaches the layer."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        wgrad = grad_out.flatten(0, -2).t() @ x.flatten(0, -2)
        weight.main_grad.add_(wgrad)
        weight.grad_added_to_main_grad = True
        return grad_out @ weight, torch.zeros_like(weight)
