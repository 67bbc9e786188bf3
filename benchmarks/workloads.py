"""The benchmark's workloads: their models, sizes, batches and losses.

Each workload names a model (built with the same seed in every process), its FSDP unit
classes, the sizes of the real run and of the smoke test, and its step counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

__all__ = [
    "SEED",
    "WORKLOADS",
    "DeepMLP",
    "DeepNormMLP",
    "EncoderLayer",
    "MLPUnit",
    "NormMLPUnit",
    "VisionEncoder",
    "VisionLanguageModel",
    "Workload",
    "build_model",
    "is_encoder_param",
    "loss_of",
    "make_batch",
    "unit_classes",
    "vars_of",
]

SEED = 1234


# ---- models -------------------------------------------------------------------------
class MLPUnit(nn.Module):
    """One small FSDP unit of the overhead-bound workload."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.fc(x))


class DeepMLP(nn.Module):
    """Many small units and nothing outside them: per-unit overhead dominates."""

    def __init__(self, n_units: int, dim: int) -> None:
        super().__init__()
        self.units = nn.ModuleList(MLPUnit(dim) for _ in range(n_units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.units:
            x = unit(x)
        return x


class NormMLPUnit(nn.Module):
    """One unit of the blocks workload: a pre-norm two-layer MLP with a residual, as
    real transformer blocks hold several small parameters (6 here)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class DeepNormMLP(nn.Module):
    """Many units of several small parameters each, nothing outside them."""

    def __init__(self, n_units: int, dim: int) -> None:
        super().__init__()
        self.units = nn.ModuleList(NormMLPUnit(dim) for _ in range(n_units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.units:
            x = unit(x)
        return x


class EncoderLayer(nn.Module):
    """Pre-norm bidirectional transformer layer of the vision encoder."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class VisionEncoder(nn.Module):
    """A ViT-like tower over flattened patches; one FSDP unit, frozen."""

    def __init__(self, patch_dim: int, dim: int, n_layers: int, n_heads: int) -> None:
        super().__init__()
        self.patch = nn.Linear(patch_dim, dim)
        self.layers = nn.ModuleList(EncoderLayer(dim, n_heads) for _ in range(n_layers))
        self.ln = nn.LayerNorm(dim)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.patch(patches)
        for layer in self.layers:
            x = layer(x)
        return self.ln(x)


class VisionLanguageModel(nn.Module):
    """Frozen vision encoder, trainable projector and GPT-style decoder (``Block`` units)."""

    def __init__(self, patch_dim: int, enc_dim: int, enc_layers: int, dec: GPTConfig) -> None:
        super().__init__()
        self.encoder = VisionEncoder(patch_dim, enc_dim, enc_layers, max(1, enc_dim // 64))
        self.encoder.requires_grad_(False)
        self.projector = nn.Linear(enc_dim, dec.dim)
        self.tok = nn.Embedding(dec.vocab_size, dec.dim)
        self.pos = nn.Embedding(dec.max_seq_len, dec.dim)
        self.blocks = nn.ModuleList(Block(dec) for _ in range(dec.n_layers))
        self.ln_f = nn.LayerNorm(dec.dim)
        self.head = nn.Linear(dec.dim, dec.vocab_size, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, patches: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        image = self.projector(self.encoder(patches))
        text = self.tok(idx)
        x = torch.cat([image, text], dim=1)
        x = x + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x[:, image.shape[1] :]))


# ---- workloads ----------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    full: dict[str, Any]  # sizes of the real benchmark
    tiny: dict[str, Any]  # sizes for the smoke test
    steps: int  # timed steps per repetition
    warmup: int


WORKLOADS: dict[str, Workload] = {
    "overhead": Workload(
        "overhead",
        "64 units of Linear(64,64)+ReLU, batch 8 per rank: per-unit overhead dominates",
        full={"n_units": 64, "dim": 64, "batch": 8},
        tiny={"n_units": 8, "dim": 16, "batch": 2},
        steps=20,
        warmup=3,
    ),
    "blocks": Workload(
        "blocks",
        "64 units of LayerNorm(64)+Linear(64,256)+GELU+Linear(256,64), batch 32 per rank: "
        "several small parameters per unit, per-unit and per-parameter overhead",
        full={"n_units": 64, "dim": 64, "batch": 32},
        tiny={"n_units": 8, "dim": 16, "batch": 2},
        steps=10,
        warmup=2,
    ),
    "compute": Workload(
        "compute",
        "GPT, 49M parameters (13 blocks, dim 512, vocab 16384), batch 2x64 tokens per rank",
        full={"vocab": 16384, "dim": 512, "heads": 8, "layers": 13, "seq": 64, "batch": 2},
        tiny={"vocab": 64, "dim": 32, "heads": 4, "layers": 2, "seq": 8, "batch": 2},
        steps=3,
        warmup=1,
    ),
    "frozen": Workload(
        "frozen",
        "vision-language: frozen 14M-parameter encoder (one unit), trainable 4M decoder "
        "(4 blocks), 64 patches + 32 tokens, batch 2 per rank",
        full={
            "patch_dim": 192,
            "patches": 64,
            "enc_dim": 384,
            "enc_layers": 8,
            "vocab": 4096,
            "dim": 256,
            "heads": 4,
            "layers": 4,
            "seq": 32,
            "batch": 2,
        },
        tiny={
            "patch_dim": 12,
            "patches": 4,
            "enc_dim": 32,
            "enc_layers": 2,
            "vocab": 64,
            "dim": 32,
            "heads": 4,
            "layers": 2,
            "seq": 8,
            "batch": 2,
        },
        steps=5,
        warmup=2,
    ),
}


def vars_of(wl: Workload, tiny: bool, size: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a run of ``wl`` uses: its sizes (``size`` overrides them), steps and warm-up."""
    return {
        "description": wl.description,
        "size": size or (wl.tiny if tiny else wl.full),
        "steps": 2 if tiny else wl.steps,
        "warmup": 1 if tiny else wl.warmup,
    }


def build_model(workload: str, size: dict[str, Any]) -> nn.Module:
    torch.manual_seed(SEED)
    if workload == "overhead":
        return DeepMLP(size["n_units"], size["dim"])
    if workload == "blocks":
        return DeepNormMLP(size["n_units"], size["dim"])
    if workload == "compute":
        cfg = GPTConfig(
            vocab_size=size["vocab"],
            max_seq_len=size["seq"],
            dim=size["dim"],
            n_heads=size["heads"],
            n_layers=size["layers"],
        )
        return GPT(cfg)
    if workload == "frozen":
        dec = GPTConfig(
            vocab_size=size["vocab"],
            max_seq_len=size["patches"] + size["seq"],
            dim=size["dim"],
            n_heads=size["heads"],
            n_layers=size["layers"],
        )
        return VisionLanguageModel(size["patch_dim"], size["enc_dim"], size["enc_layers"], dec)
    raise ValueError(f"unknown workload {workload!r}; choose from {sorted(WORKLOADS)}")


def unit_classes(workload: str) -> list[type[nn.Module]]:
    return {
        "overhead": [MLPUnit],
        "blocks": [NormMLPUnit],
        "compute": [Block],
        "frozen": [VisionEncoder, Block],
    }[workload]


def make_batch(
    workload: str, size: dict[str, Any], step: int, rank: int, world: int, device: torch.device
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Rank ``rank``'s rows of the global batch of ``step``: (inputs, targets)."""
    b = size["batch"]
    rows = slice(rank * b, (rank + 1) * b)
    if workload in ("overhead", "blocks"):
        g = torch.Generator().manual_seed(SEED + step)
        x = torch.randn(b * world, size["dim"], generator=g)
        y = torch.randn(b * world, size["dim"], generator=g)
        return (x[rows].to(device),), y[rows].to(device)
    x, y = token_batch(step, b * world, size["seq"], size["vocab"], seed=SEED)
    if workload == "compute":
        return (x[rows].to(device),), y[rows].to(device)
    g = torch.Generator().manual_seed(SEED + step)
    patches = torch.randn(b * world, size["patches"], size["patch_dim"], generator=g)
    return (patches[rows].to(device), x[rows].to(device)), y[rows].to(device)


def loss_of(workload: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if workload in ("overhead", "blocks"):
        return F.mse_loss(output, target)
    return F.cross_entropy(output.flatten(0, 1).float(), target.flatten())


def is_encoder_param(name: str) -> bool:
    return name.startswith("encoder.")
