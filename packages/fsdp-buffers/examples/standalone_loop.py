"""A training loop that uses only fsdp-mesh and fsdp-buffers: no module hooks.

Run it on 2 CPU ranks:  uv run torchrun --nproc-per-node 2 packages/fsdp-buffers/examples/standalone_loop.py

Each step: gather every bucket (compute weights become views into the gathered
buckets), forward and backward on this rank's slice of the batch, reduce the gradients
(post-accumulate-grad hooks feed them to the pipeline as they are produced), release
the buckets, step a plain torch optimizer on the sharded fp32 main weights (DTensors),
and install the updated weights into the compute weights.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_buffers import (
    AllGatherPipeline,
    GradReducePipeline,
    MixedPrecisionPolicy,
    ParamAndGradBuffer,
)
from fsdp_mesh import FSDPDistributedIndex


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyModel(nn.Module):
    def __init__(self, in_dim: int = 6, dim: int = 16, out_dim: int = 3, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: the same on every rank and in the reference."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(global_batch, 6, generator=g), torch.randn(global_batch, 3, generator=g)


def train(
    strategy: int | str = "optim_grads_params",
    steps: int = 10,
    per_rank_batch: int = 4,
    seed: int = 0,
    lr: float = 1e-2,
) -> dict[str, object]:
    """Train on every rank of the default process group; returns the global loss of
    each step and the full final parameters (gathered from the shards)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = TinyModel()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    index = FSDPDistributedIndex(mesh, dp_shard_dim="dp")
    buffers = ParamAndGradBuffer(
        model,
        index,
        strategy=strategy,
        mixed_precision_policy=MixedPrecisionPolicy(),
        fsdp_unit_modules=[Block],
    )
    gather = AllGatherPipeline(buffers)
    reduce = GradReducePipeline(buffers)
    reduce.register_grad_hooks()
    named = buffers.views.optimizer_named_parameters()
    optimizer = torch.optim.AdamW([p for _, p in named], lr=lr, weight_decay=0.01)

    losses = []
    for step in range(steps):
        x, y = batch(step, per_rank_batch * world)
        mine = slice(rank * per_rank_batch, (rank + 1) * per_rank_batch)
        gather.all_gather_params(range(buffers.num_buckets))
        loss = nn.functional.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        reduce.finish()  # every bucket reduced into the main-grad shards
        gather.reset()  # release the gathered buckets
        optimizer.step()
        buffers.install_optimized_model_weights()
        optimizer.zero_grad(set_to_none=False)
        buffers.zero_grad_buffer()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)

    # Whole parameters from the row shards (a collective; every rank calls it).
    final = {
        name: buffers.views.full_parameter(name)
        for name, _ in buffers.views.optimizer_named_parameters()
    }
    return {"losses": losses, "params": final}


def reference(steps: int = 10, global_batch: int = 8, seed: int = 0, lr: float = 1e-2):
    """The same model and data in one process, without fsdp."""
    torch.manual_seed(seed)
    model = TinyModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for step in range(steps):
        x, y = batch(step, global_batch)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def main() -> None:
    dist.init_process_group("gloo")
    out = train(os.environ.get("FSDP_STRATEGY", "optim_grads_params"))
    if dist.get_rank() == 0:
        ref = reference(global_batch=4 * dist.get_world_size())
        for step, (a, b) in enumerate(zip(out["losses"], ref["losses"], strict=True)):
            print(f"step {step}: loss {a:.6f}  reference {b:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
