"""A Llama-shaped decoder built from ``nn.Linear`` / ``nn.Embedding`` / ``nn.RMSNorm``:
the shapes of Llama 3 70B at the defaults (no attention math: the planner reads shapes)."""

from __future__ import annotations

from torch import nn


class DecoderLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        head_dim = hidden // heads
        self.input_layernorm = nn.RMSNorm(hidden)
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(hidden)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)


class LlamaShaped(nn.Module):
    def __init__(
        self,
        vocab: int = 128_256,
        hidden: int = 8192,
        intermediate: int = 28_672,
        layers: int = 80,
        heads: int = 64,
        kv_heads: int = 8,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            DecoderLayer(hidden, intermediate, heads, kv_heads) for _ in range(layers)
        )
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
