"""The demo's model: ``fsdp_mesh.testing.models.GPT`` at about 3.2 million parameters,
initialized as GPT-2 is (small normal weights, zero biases), so that the first loss is
close to ln(vocabulary size) instead of dominated by huge initial logits."""

from __future__ import annotations

import math

import torch
from torch import nn

from fsdp_mesh.testing.models import GPT, Block, GPTConfig

__all__ = ["Block", "build_model", "model_config"]

INIT_STD = 0.02


def model_config(vocab_size: int, seq_len: int) -> GPTConfig:
    """4 blocks of width 256 with 8 heads: about 3.2 million parameters."""
    return GPTConfig(vocab_size=vocab_size, max_seq_len=seq_len, dim=256, n_heads=8, n_layers=4)


def build_model(cfg: GPTConfig, seed: int) -> GPT:
    """The same model on every rank for the same ``seed``."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    # Residual projections are scaled down by depth (GPT-2), so the residual stream's
    # variance does not grow with the number of blocks.
    residual_std = INIT_STD / math.sqrt(2 * cfg.n_layers)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                is_residual = name.endswith(("attn.proj", "mlp.2"))
                module.weight.normal_(0.0, residual_std if is_residual else INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
    return model
