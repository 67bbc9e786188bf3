"""Torch's own tools on the DTensors we hand out, with no fsdp checkpoint function.

Every sharded DTensor of ``model.state_dict()``, ``optimizer.state_dict()``,
``model.parameters()`` and their ``.grad`` is DTensor's ``torch.chunk`` piece (issue
"torch-native state"), so:

* a plain ``dcp.save``/``dcp.load`` round trip of model and optimizer state restores every
  value (the bug this file first reproduced: half of each parameter silently not restored),
  and so does ``dcp.async_save`` while training steps on during the write;
* ``full_tensor()`` of every entry equals the one-process tensor;
* DTensor ops on parameters and gradients (``mean``, ``std``, ``max``, ``redistribute``)
  give what they give on the full tensor;
* a plain DCP checkpoint of torch's ``get_state_dict`` reshards: saved at 2 ranks under
  ZeRO-3, loaded with ``dcp.load`` + ``set_state_dict`` into a fresh model and optimizer
  at 1, 2 and 4 ranks under every strategy, training continues at one-process parity.

The model has odd shapes on purpose: rows not divisible by the world size, a parameter
with fewer rows than ranks, a 0-d parameter, tied weights and a frozen parameter.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Replicate
from torch.nn import functional as F

from fsdp_ckpt import HostStager
from fsdp_hooks import fully_shard
from fsdp_mesh.testing import harness_device, harness_device_type, run_distributed

# Runs on CUDA + NCCL under --fsdp-device cuda (root conftest.py).
pytestmark = pytest.mark.cuda

GLOBAL_BATCH = 4
STRATEGIES = [0, 1, 2, 3]


class Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(10)
        self.up = nn.Linear(10, 7)  # 7 rows: uneven at 2 and 4 ranks
        self.down = nn.Linear(7, 10)
        self.gate = nn.Parameter(torch.tensor(0.5))  # 0-d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * self.down(F.gelu(self.up(self.norm(x))))


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 10)  # 13 rows
        self.units = nn.ModuleList([Unit(), Unit()])
        self.tiny = nn.Linear(10, 3)  # 3 rows: fewer than 4 ranks
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(10, 13, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for unit in self.units:
            h = unit(h)
        # The side path feeds 3 of the 13 logits (a broadcast to all of them would get a
        # zero gradient, and AdamW would amplify its rounding noise).
        return self.head(h) + F.pad(self.frozen(self.tiny(h)), (0, 10))


def _device() -> torch.device:
    """Where this process trains: a rank on its own device; the test process (the
    one-process reference) on the device type the ranks use, so that both run the same
    kernels, as the 1e-5 comparisons assume (CPU and CUDA kernels round differently)."""
    return harness_device() if dist.is_initialized() else torch.device(harness_device_type())


def _fresh(seed: int) -> tuple[Odd, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Odd().to(_device())
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 13, (GLOBAL_BATCH, 5), generator=g)
    y = torch.randint(0, 13, (GLOBAL_BATCH, 5), generator=g)
    return x.to(_device()), y.to(_device())


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _train(model, opt, start: int, stop: int) -> list[float]:
    rank, world = _rank_world()
    b = GLOBAL_BATCH // world
    losses = []
    for step in range(start, stop):
        x, y = _batch(step)
        x, y = x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _wrap(seed: int, strategy: int):
    module, opt = _fresh(seed)
    return fully_shard(module, opt, fsdp_unit_modules=[Unit], zero_dp_strategy=strategy)


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def _reference(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    module, opt = _fresh(0)
    losses = _train(module, opt, 0, steps)
    return losses, {k: v.detach().clone() for k, v in module.state_dict().items()}


def _whole_values(model, opt) -> tuple[dict, dict]:
    """The model's and the optimizer state's whole tensors, copied: what a load restores."""
    saved_model = {k: _full(v).clone() for k, v in model.state_dict().items()}
    saved_optim = {
        (pid, key): _full(value).clone()
        for pid, state in opt.state_dict()["state"].items()
        for key, value in state.items()
    }
    return saved_model, saved_optim


def _load_and_compare(path: str, model, opt, saved_model: dict, saved_optim: dict) -> None:
    """``dcp.load`` into ``model``/``opt`` in place, then every value equals the saved one."""
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])

    for key, value in model.state_dict().items():
        torch.testing.assert_close(_full(value), saved_model[key], rtol=0, atol=0, msg=key)
    for pid, st in opt.state_dict()["state"].items():
        for key, value in st.items():
            torch.testing.assert_close(_full(value), saved_optim[(pid, key)], rtol=0, atol=0)


# ---- a plain DCP round trip restores every value --------------------------------------------
def _round_trip(path: str, strategy: int) -> None:
    model, opt = _wrap(0, strategy)
    _train(model, opt, 0, 2)
    saved_model, saved_optim = _whole_values(model, opt)
    assert saved_optim, "the optimizer has state after two steps"
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    if _rank_world()[0] == 0:  # torch's offline converter reads the same values
        flat = f"{path}.pt"
        dcp_to_torch_save(path, flat)
        converted = torch.load(flat, weights_only=False)["model"]
        assert set(converted) == set(saved_model)
        for key, value in saved_model.items():  # torch.load gives CPU tensors
            torch.testing.assert_close(converted[key], value.cpu(), rtol=0, atol=0, msg=key)

    # Scramble everything the checkpoint should restore.
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
        for state in opt.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    value.fill_(3.0)
    _load_and_compare(path, model, opt, saved_model, saved_optim)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_plain_dcp_round_trip_restores_every_value(tmp_path, world, strategy):
    run_distributed(_round_trip, world, args=(str(tmp_path / "ckpt"), strategy))


# ---- dcp.async_save: training goes on while it writes, the call's values come back ---------
def _async_round_trip(path: str, strategy: int, stager_kind: str) -> None:
    """With torch's recommended setup: a gloo group of its own for the background
    collectives (the default group's stay with training), and fsdp's ``HostStager``
    (buffers reused from one save to the next) or DCP's default stager (a fresh copy per
    save; it needs every DTensor's local tensor to own its storage from offset 0,
    Note [picklable views] in ``fsdp_buffers.dtensor_views``)."""
    group = dist.new_group(backend="gloo") if dist.is_initialized() else None
    stager = HostStager() if stager_kind == "host" else None
    model, opt = _wrap(0, strategy)
    _train(model, opt, 0, 2)
    saved_model, saved_optim = _whole_values(model, opt)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    # The write is held until training has stepped: the copy is what gets written.
    FileSystemWriter.write_data = _write_after_the_step
    future = dcp.async_save(state, checkpoint_id=path, async_stager=stager, process_group=group)
    _train(model, opt, 2, 3)  # changes every live value while the save waits to write
    _STEPPED.set()
    future.result()
    FileSystemWriter.write_data = _WRITE

    fresh, fresh_opt = _wrap(1, strategy)
    _train(fresh, fresh_opt, 0, 1)  # an optimizer state to load into
    _load_and_compare(path, fresh, fresh_opt, saved_model, saved_optim)


@pytest.mark.parametrize("stager_kind", ["host", "default"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_plain_dcp_async_save_round_trip(tmp_path, strategy, stager_kind):
    run_distributed(_async_round_trip, 2, args=(str(tmp_path / "ckpt"), strategy, stager_kind))


_WRITE = FileSystemWriter.write_data
_STEPPED = threading.Event()


def _write_after_the_step(self, *args, **kwargs):
    assert _STEPPED.wait(60), "the training step never came"
    return _WRITE(self, *args, **kwargs)


# ---- full_tensor() and DTensor ops equal the one-process tensors ----------------------------
_OPS = {
    "mean": lambda t: t.mean(),
    "abs_mean": lambda t: t.abs().mean(),
    "sq_mean": lambda t: t.pow(2).mean(),
    "max": lambda t: t.max(),
    "std": lambda t: t.std() if t.numel() > 1 else t.sum(),
    "sum": lambda t: t.sum(),
    "norm": lambda t: t.norm(),
}


def _ops(strategy: int) -> dict[str, torch.Tensor]:
    model, opt = _wrap(0, strategy)
    _train(model, opt, 0, 2)
    rank, world = _rank_world()
    b = GLOBAL_BATCH // world
    x, y = _batch(2)
    F.cross_entropy(
        model(x[rank * b : (rank + 1) * b]).flatten(0, 1), y[rank * b : (rank + 1) * b].flatten()
    ).backward()
    # finish_grad_sync through the optimizer's view: attach the reduced gradients.
    model.finish_grad_sync()
    out: dict[str, torch.Tensor] = {}
    for name, p in model.module.named_parameters():
        assert isinstance(p, DTensor), name
        out[f"param.{name}"] = p.full_tensor().clone()
        out[f"replicate.{name}"] = (
            p.redistribute(placements=[Replicate()] * p.device_mesh.ndim).to_local().clone()
        )
        for op, fn in _OPS.items():
            if op == "max" and p.ndim and p.shape[0] < world:
                # torch's DTensor max() refuses a rank whose piece is empty, as it does
                # on any Shard(0) DTensor with fewer rows than ranks (FSDP2's too).
                continue
            out[f"{op}.{name}"] = _full(fn(p)).clone()
        if p.ndim:
            out[f"mean0.{name}"] = _full(p.mean(dim=0)).clone()
        if p.grad is not None:
            out[f"grad.{name}"] = p.grad.full_tensor().clone()
            out[f"grad_mean.{name}"] = _full(p.grad.mean()).clone()
    for key, value in model.state_dict().items():
        out[f"sd.{key}"] = _full(value).clone()
    for pid, st in opt.state_dict()["state"].items():
        for key, value in st.items():
            out[f"opt.{pid}.{key}"] = _full(value).clone()
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_full_tensor_and_dtensor_ops_match_one_process(strategy):
    module, opt = _fresh(0)
    _train(module, opt, 0, 2)
    x, y = _batch(2)
    F.cross_entropy(module(x).flatten(0, 1), y.flatten()).backward()
    want: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        want[f"param.{name}"] = want[f"replicate.{name}"] = p.detach()
        for op, fn in _OPS.items():
            want[f"{op}.{name}"] = fn(p.detach())
        if p.ndim:
            want[f"mean0.{name}"] = p.detach().mean(dim=0)
        if p.grad is not None:
            want[f"grad.{name}"] = p.grad
            want[f"grad_mean.{name}"] = p.grad.mean()
    for key, value in module.state_dict().items():
        want[f"sd.{key}"] = value
    want = {k: v.cpu() for k, v in want.items()}  # the ranks' results come back on the CPU
    for world in (2, 4):
        results = run_distributed(_ops, world, args=(strategy,))
        for got in results:
            skipped = {
                f"max.{n}" for n, p in module.named_parameters() if p.ndim and p.shape[0] < world
            }
            assert set(got) >= {k for k in want if not k.startswith("opt.")} - skipped, sorted(
                set(want) - set(got)
            )
            for key, value in want.items():
                if key in skipped:
                    continue
                torch.testing.assert_close(
                    got[key], value, rtol=1e-5, atol=1e-6, msg=f"{world} {key}"
                )
        # Every rank agrees on the optimizer state too (and on every other value).
        for key in results[0]:
            for other in results[1:]:
                torch.testing.assert_close(other[key], results[0][key], rtol=0, atol=0, msg=key)


# ---- plain DCP reshards across world sizes and strategies -----------------------------------
def _save_phase(path: str) -> list[float]:
    model, opt = _wrap(0, 3)
    losses = _train(model, opt, 0, 2)
    msd, osd = get_state_dict(model, opt)  # torch's API, as FSDP2 users write it
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return losses


def _load_phase(path: str, strategy: int) -> list[float]:
    # A fresh pair, seeded differently: every value must come from the checkpoint (the
    # optimizer's state exists before the first step, as Megatron-FSDP's does).
    model, opt = _wrap(1234, strategy)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _train(model, opt, 2, 4)


def test_plain_dcp_reshards_to_every_world_size_and_strategy(tmp_path):
    reference, _ = _reference(4)
    path = str(tmp_path / "ckpt")
    first = run_distributed(_save_phase, 2, args=(path,))[0]
    torch.testing.assert_close(first, reference[:2], rtol=1e-5, atol=0)
    for world in (1, 2, 4):
        for strategy in STRATEGIES:
            losses = run_distributed(_load_phase, world, args=(path, strategy))[0]
            torch.testing.assert_close(
                losses, reference[2:], rtol=1e-5, atol=0, msg=f"world {world}, strategy {strategy}"
            )
