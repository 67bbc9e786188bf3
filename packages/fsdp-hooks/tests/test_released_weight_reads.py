"""Reads of a unit's weights after ZeRO-3 released them (issue 41 items 2 and 7; Note
[released weights read later] in ``param_swap``).

A unit that returns a view of its own parameter (learned query tokens
``self.q.expand(B, -1, -1)``, a positional table ``self.pe[:T]``) handed out views of a
bucket that its post-forward then released: the process died (SIGSEGV), or with
``fsdp_double_buffer`` the views read the next unit's weights in the reused slot. Now
the views are copied out before the release: losses and weights equal one process.

A gradient penalty (``torch.autograd.grad(..., create_graph=True)``, then a loss on the
gradient's norm) builds a graph in backward that reads the weights again after their
release: it raised torch's ``setStorage ... out of bounds`` or, with double buffering,
ran on another unit's weights. Now it raises on every rank naming fsdp, the unit and
double backward, and the model trains on afterwards; ZeRO-2 (the alternative the
message names) equals one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from fsdp_hooks import fully_shard
from fsdp_mesh.testing import assert_same_training, mean_over_ranks, run_distributed

WORLD = 2
STEPS = 3
BATCH = 2
SEQ = 3
DIM = 8
QUERIES = 2
LR = 1e-2
PENALTY = 0.1


class QueryBlock(nn.Module):
    """Returns views of its own parameters beside its hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Parameter(torch.randn(QUERIES, DIM))
        self.pe = nn.Parameter(torch.randn(2 * SEQ, DIM))
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = h.shape
        pe = self.pe[:t]
        return torch.tanh(self.fc(h + pe)), self.q.expand(b, -1, -1), pe


class QueryModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(QueryBlock() for _ in range(4))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        views = []
        h = x
        for block in self.blocks:
            h, q, pe = block(h)
            views += [q, pe]
        # Read once every later unit ran (and released, or refilled the slot).
        extra = sum(v.pow(2).mean() for v in views)
        return self.head(h).mean(dim=(1, 2)) + extra


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(BATCH, generator=g)


def _train_views(configs) -> dict:
    rank = dist.get_rank()
    out = {}
    for strategy, double_buffer in configs:
        torch.manual_seed(0)
        module = QueryModel()
        model, optimizer = fully_shard(
            module,
            torch.optim.AdamW(module.parameters(), lr=LR),
            fsdp_unit_modules=[QueryBlock],
            zero_dp_strategy=strategy,
            fsdp_double_buffer=double_buffer,
        )
        losses = []
        for step in range(STEPS):
            x, y = _batch(step, rank)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(mean_over_ranks(loss))
        with torch.no_grad():  # eval: the buckets are released right after the forward
            eval_out = model(_batch(STEPS, 0)[0])
        out[(strategy, double_buffer)] = {
            "losses": losses,
            "params": model.buffer.views.full_parameters(),
            "eval": eval_out,
        }
    return out if rank == 0 else {}


def _reference_views() -> dict:
    torch.manual_seed(0)
    model = QueryModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        batches = [_batch(step, r) for r in range(WORLD)]
        loss = sum(F.mse_loss(model(x), y) for x, y in batches) / WORLD
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        eval_out = model(_batch(STEPS, 0)[0])
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "eval": eval_out}


VIEW_CONFIGS = ((2, False), (3, False), (3, True))


def test_unit_outputs_that_view_their_parameters():
    """Views of a unit's own parameters among its outputs keep their values after the
    unit's release (copied out), under ZeRO-3 with and without double buffering: the
    same training as one process, and the same eval output."""
    ref = _reference_views()
    runs = run_distributed(_train_views, WORLD, args=(VIEW_CONFIGS,), timeout=120)[0]
    for strategy, double_buffer in VIEW_CONFIGS:
        got = runs[(strategy, double_buffer)]
        where = f"views zero{strategy} double{int(double_buffer)}"
        assert_same_training(
            {"losses": got["losses"], "params": got["params"]},
            {"losses": ref["losses"], "params": ref["params"]},
            where=where,
        )
        torch.testing.assert_close(got["eval"], ref["eval"], rtol=1e-5, atol=1e-5, msg=where)


class PenaltyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(h))


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(PenaltyBlock() for _ in range(3))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)


def _penalty_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """WGAN-GP style: the task loss plus a penalty on the input gradient's norm."""
    x = x.clone().requires_grad_()
    out = model(x)
    (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return F.mse_loss(out, y) + PENALTY * (grad.norm(dim=-1) - 1).pow(2).mean()


def _penalty_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 * step + rank)
    return torch.randn(4, DIM, generator=g), torch.randn(4, generator=g)


def _train_penalty(strategy: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = Critic()
    model, optimizer = fully_shard(
        module,
        torch.optim.AdamW(module.parameters(), lr=LR),
        fsdp_unit_modules=[PenaltyBlock],
        zero_dp_strategy=strategy,
    )
    losses = []
    for step in range(STEPS):
        loss = _penalty_loss(model, *_penalty_batch(step, rank))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss))
    return {"losses": losses, "params": model.buffer.views.full_parameters()}


def _reference_penalty() -> dict:
    torch.manual_seed(0)
    model = Critic()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = sum(_penalty_loss(model, *_penalty_batch(step, r)) for r in range(WORLD)) / WORLD
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _train_penalties(strategies) -> dict:
    return {s: _train_penalty(s) for s in strategies}


def test_gradient_penalty_without_sharded_weights_equals_one_process():
    """The alternative the ZeRO-3 error names: a double backward with the weights kept
    (ZeRO-2), and plain data parallel."""
    ref = _reference_penalty()
    runs = run_distributed(_train_penalties, WORLD, args=((0, 2),), timeout=120)[0]
    for strategy, got in runs.items():
        assert_same_training(got, ref, where=f"gradient penalty zero{strategy}")


def _penalty_under_zero3(double_buffer: bool, regather: bool) -> str:
    torch.manual_seed(0)
    module = Critic()
    model, optimizer = fully_shard(
        module,
        torch.optim.AdamW(module.parameters(), lr=LR),
        fsdp_unit_modules=[PenaltyBlock],
        zero_dp_strategy=3,
        fsdp_double_buffer=double_buffer,
        regather_saved_weights=regather,
    )
    x, y = _penalty_batch(0, dist.get_rank())
    try:
        _penalty_loss(model, x, y).backward()
        message = "no error"
    except RuntimeError as err:
        message = str(err)
    # The error is one users can catch: the next step trains (raises otherwise).
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    return message


PENALTY_CONFIGS = ((False, False), (True, False), (False, True))  # double buffer, regather


def _penalties_under_zero3() -> list[str]:
    return [_penalty_under_zero3(*config) for config in PENALTY_CONFIGS]


def test_gradient_penalty_under_zero3_raises_on_every_rank():
    """With and without double buffering, and with regathering (which covers tensors
    saved in forward only), on every rank; the model trains on after it."""
    for messages in run_distributed(_penalties_under_zero3, WORLD, timeout=90):
        for config, message in zip(PENALTY_CONFIGS, messages, strict=True):
            where = f"double_buffer, regather = {config}: {message}"
            assert message.startswith("fsdp: a backward with create_graph=True"), where
            assert "double backward" in message and "'blocks.2'" in message, where
            assert "zero_dp_strategy=2" in message, where


# ---- a view of a root parameter returned by the model --------------------------------


class RootViewModel(nn.Module):
    """A positional table at the root (outside every unit), returned as a view."""

    def __init__(self) -> None:
        super().__init__()
        self.pe = nn.Parameter(torch.randn(2 * SEQ, DIM))
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pe = self.pe[: h.shape[1]]
        h = h + pe
        for block in self.blocks:
            h = torch.tanh(block(h))
        return h, pe


def _root_view_job(double_buffer: bool):
    torch.manual_seed(0)
    net = RootViewModel()
    want = net.pe.detach()[:SEQ].clone()
    model, _opt = fully_shard(
        net,
        torch.optim.SGD(net.parameters(), lr=LR),
        fsdp_unit_modules=[nn.Linear],
        zero_dp_strategy=3,
        fsdp_double_buffer=double_buffer,
    )
    model.eval()
    with torch.no_grad():
        _h, kept = model(torch.randn(BATCH, SEQ, DIM))
        # The root bucket is released after this forward and gathered again by the next,
        # whose memory may take its place: the kept view must still hold its values.
        for _ in range(3):
            model(torch.randn(BATCH, SEQ, DIM))
    return torch.equal(kept, want)


def test_a_view_of_a_root_parameter_keeps_its_values():
    for double_buffer in (False, True):
        assert run_distributed(_root_view_job, WORLD, args=(double_buffer,)) == [True] * WORLD
