"""torchtitan's meta-device initialization on ``fully_shard`` (issue 40 item 5), world 2
against one process, ZeRO-0 to 3.

The model is built as torchtitan builds its Llama: its state comes from the root's
``init_weights()``, which recomputes a RoPE-like cache buffer (``freqs``, on the root,
whose module has no ``reset_parameters()``) and writes every parameter; the init is
deterministic per parameter (a generator seeded by its name), so the sharded model
must end with exactly the one-process weights.

- FSDP2's route: build on the meta device, ``fully_shard`` (no flag), then
  ``model.to_empty(device=...)`` and ``model.init_weights()``. Before the init, the
  parameters read NaN (a forgotten init is loud, never plausible zeros);
- the flag route (``init_model_with_meta_device=True``): the modules' resets run, then
  fsdp calls the root's ``init_weights()`` for the buffer no reset reaches.

Both then train three steps at parity with the one-process model (losses, weights). An
``init_weights()`` that leaves the buffer uninitialized is refused on every rank.
"""

from __future__ import annotations

import functools
import math
import zlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn import functional as F

from fsdp_hooks import fully_shard
from fsdp_mesh.testing import assert_tensors_close, run_distributed

WORLD = 2
VOCAB, DIM, SEQ, LAYERS, BATCH = 32, 8, 6, 2, 4
STEPS = 3
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        return x + self.wo(torch.tanh(self.wq(self.norm(x)) * freqs))


class TitanLike(nn.Module):
    """torchtitan's shape of model: a cache buffer computed in ``__init__`` and again
    in ``init_weights()``, no ``reset_parameters()`` on the module that holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("freqs", self._precompute_freqs(), persistent=True)

    @staticmethod
    def _precompute_freqs() -> torch.Tensor:
        inv = 1.0 / (100.0 ** (torch.arange(DIM, dtype=torch.float32) / DIM))
        return torch.cos(torch.arange(SEQ, dtype=torch.float32)[:, None] * inv[None, :])

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        buffer_device = buffer_device or self.freqs.device
        with torch.device(buffer_device):
            self.freqs = self._precompute_freqs()
        with torch.no_grad():
            for name, p in self.named_parameters():
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                full = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
                if isinstance(p, DTensor):  # the sharded model's parameters
                    full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
                p.copy_(full)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x, self.freqs[: idx.shape[1]])
        return self.out(x)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _train(model, opt, rows: slice) -> list[float]:
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


@functools.cache
def _reference() -> dict:
    torch.manual_seed(0)
    model = TitanLike()
    model.init_weights()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    losses = _train(model, _optimizer(model.parameters()), slice(None))
    return {"init": init, "losses": losses, "final": dict(model.state_dict())}


def _full(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in get_model_state_dict(model, options=FULL).items()}


def _run(route: str, strategy: int) -> dict:
    rank = dist.get_rank()
    rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    torch.manual_seed(0)
    with torch.device("meta"):
        module = TitanLike()
    got: dict = {}
    flag = route == "flag"
    model, opt = fully_shard(
        module,
        _optimizer(module.parameters()),
        fsdp_unit_modules=[Layer],
        zero_dp_strategy=strategy,
        init_model_with_meta_device=flag,
    )
    if not flag:  # FSDP2's way
        got["before_init_nan"] = [
            n for n, p in model.named_parameters() if not bool(p.full_tensor().isnan().all())
        ]
        model.to_empty(device="cpu")
        model.init_weights()
    got["init"] = _full(model)
    got["losses"] = [float(loss) for loss in _train(model, opt, rows)]
    # The loss of each rank's half; the one-process loss is their mean.
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, got["losses"])
    got["losses"] = [sum(values) / WORLD for values in zip(*gathered, strict=True)]
    got["final"] = _full(model)
    return got


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
@pytest.mark.parametrize("route", ["fsdp2", "flag"])
def test_torchtitan_meta_init_matches_one_process(route, strategy):
    ref = _reference()
    got = run_distributed(_run, WORLD, args=(route, strategy), timeout=120)[0]
    where = f"{route} ZeRO-{strategy}"
    if route == "fsdp2":
        assert got["before_init_nan"] == [], f"{where}: not NaN before init_weights()"
    assert_tensors_close(got["init"], ref["init"], where=f"{where} after init")
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.stack(ref["losses"]), rtol=1e-5, atol=1e-6
    )
    assert_tensors_close(got["final"], ref["final"], where=f"{where} after {STEPS} steps")


class Forgetful(TitanLike):
    """An ``init_weights()`` that forgets the cache buffer."""

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        with torch.no_grad():
            for p in self.parameters():
                p.zero_()


def _forgetful() -> str:
    torch.manual_seed(0)
    with torch.device("meta"):
        module = Forgetful()
    try:
        fully_shard(module, _optimizer(module.parameters()), init_model_with_meta_device=True)
    except ValueError as e:
        return str(e)
    return "no error"


def test_flag_route_refuses_a_buffer_init_weights_leaves_uninitialized():
    for rank, message in enumerate(run_distributed(_forgetful, WORLD, timeout=60)):
        assert "['freqs']" in message and "uninitialized" in message, f"rank {rank}: {message}"
