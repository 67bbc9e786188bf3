"""Whole-matrix optimizers (``torch.optim.Muon``, ``Adafactor``) under ZeRO-1/2/3: each
matrix is held whole by one rank (Note [whole placement] in ``fsdp_buffers.layout``),
which steps it.

Parity: 10 steps of ``fully_shard`` training at world sizes 2 and 4, ZeRO-1/2/3 (and HSDP
at 2 x 2), give the losses, gradient norms and weights of one process running
``torch.optim.Muon`` (alone, on a bias-free model whose parameters are all matrices; or
for the hidden matrices beside AdamW for the rest, through ``fully_shard(module, [muon,
adamw])``) or ``Adafactor`` (every parameter; its per-tensor RMS made row-sharded 1-d
parameters step wrongly before) on the same global batch, within 1e-5 relative. Each
FSDP unit has two matrices, so at world size 4 a unit has fewer matrices than ranks and
the owners are balanced across buckets.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from fsdp_hooks import fully_shard
from fsdp_mesh import build_device_mesh
from fsdp_mesh.testing import assert_losses_close, assert_same_training, run_distributed

pytestmark = pytest.mark.skipif(
    not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9"
)

STRATEGIES = (1, 2, 3)
STEPS = 10
GLOBAL_BATCH = 8
DIM, HIDDEN, IN, OUT, LAYERS = 16, 24, 8, 4, 3
# Muon rounds its update to bf16 (Newton-Schulz in bf16), so the last-bit differences
# between the ranks' gradient reduction order (gloo's ring at world size 4) and any
# one-process order flip some bf16 roundings. At lr 2e-2 that drifts the losses by 1e-5
# after ~5 steps whichever order the reference sums in (measured: sequential, pairwise and
# reversed orders each drift from step 4 to 9); at 5e-3 every order stays within 1e-7 for
# ten steps, and the losses still fall (checked below). AdamW's eps bounds its gain on
# gradients that are rounding noise (as in test_parity).
MUON_LR, ADAMW_LR = 5e-3, 5e-3
ADAM_EPS = 1e-3
NO_CLIP = 1e6  # clip_grad_norm_ for its norm only (a factor of exactly 1)


class Layer(nn.Module):
    """The FSDP unit: two matrices (and, with ``bias``, a norm and biases)."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM) if bias else nn.Identity()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=bias)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, DIM, bias=bias)
        self.layers = nn.ModuleList(Layer(bias) for _ in range(LAYERS))
        self.head = nn.Linear(DIM, OUT, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def build(kind: str) -> Net:
    torch.manual_seed(0)
    return Net(bias=kind != "muon")


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and name.startswith("layers.")


def optimizers(kind: str, module: nn.Module) -> list[torch.optim.Optimizer]:
    """``muon``: one stock Muon over every parameter (all matrices). ``split``: Muon for
    the hidden matrices, AdamW for embedding, head, norms and biases."""
    if kind == "muon":
        return [torch.optim.Muon(module.parameters(), lr=MUON_LR)]
    if kind == "adafactor":  # factored second moments: whole rows and columns
        return [torch.optim.Adafactor(module.parameters(), lr=ADAMW_LR)]
    named = list(module.named_parameters())
    hidden = [p for n, p in named if is_hidden_matrix(n, p)]
    rest = [p for n, p in named if not is_hidden_matrix(n, p)]
    return [
        torch.optim.Muon(hidden, lr=MUON_LR),
        torch.optim.AdamW(rest, lr=ADAMW_LR, eps=ADAM_EPS),
    ]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two batches in turn: the losses fall, so the steps do something."""
    g = torch.Generator().manual_seed(1000 + step % 2)
    return torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)


def edit_groups(opts: list[torch.optim.Optimizer], step: int, moved: list) -> None:
    """Param-group edits between steps, as a user makes them: before step 2 the first of
    Muon's matrices leaves its group (popped in place: the same list object), before step
    4 it comes back in a group of its own at twice the learning rate."""
    if step == 2:
        moved.append(opts[0].param_groups[0]["params"].pop(0))
    elif step == 4:
        opts[0].add_param_group({"params": moved, "lr": 2 * MUON_LR})


@functools.cache
def reference(
    kind: str,
    slices: int,
    steps: int = STEPS,
    pairwise: bool = False,
    resumed: tuple[int, int] | None = None,
    edits: bool = False,
) -> dict:
    """One process, no fsdp, the global batch; its gradient is the mean of the gradients
    of ``slices`` equal slices (as the ranks compute it), summed in slice order, or in
    pairs first with ``pairwise`` (HSDP's order: over each shard group, then across the
    outer dim; see MUON_LR on summation order). ``resumed=(step, slices)``: from that step
    on, that many slices (a checkpoint loaded at another world size). ``edits``: with
    ``edit_groups``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks
    try:
        module = build(kind)
        opts = optimizers(kind, module)
        losses, norms = [], []
        first, moved = slices, []
        for step in range(steps):
            if edits:
                edit_groups(opts, step, moved)
                # fsdp's zero_grad clears every gradient (its whole buffer), torch's only
                # those of its groups: the matrix outside them must not accumulate here.
                module.zero_grad()
            slices = resumed[1] if resumed is not None and step >= resumed[0] else first
            per = GLOBAL_BATCH // slices
            x, y = batch(step)
            parts: list[dict[nn.Parameter, torch.Tensor]] = []
            total = 0.0
            for k in range(slices):
                part = slice(k * per, (k + 1) * per)
                loss = F.mse_loss(module(x[part]), y[part])
                loss.backward()
                parts.append({p: p.grad * (1.0 / slices) for p in module.parameters()})
                for p in module.parameters():
                    p.grad = None
                total += loss.item()
            for p in module.parameters():
                gs = [d[p] for d in parts]
                if pairwise:
                    gs = [gs[i] + gs[i + 1] for i in range(0, len(gs), 2)]
                p.grad = functools.reduce(torch.add, gs)
            norms.append(torch.nn.utils.clip_grad_norm_(module.parameters(), NO_CLIP).item())
            for opt in opts:
                opt.step()
                opt.zero_grad()
            losses.append(total / slices)
        params = {n: p.detach().clone() for n, p in module.named_parameters()}
        return {"losses": losses, "norms": norms, "params": params}
    finally:
        torch.set_num_threads(threads)


def _train(
    kinds: tuple[str, ...],
    strategies: tuple[int, ...] = STRATEGIES,
    steps: int = STEPS,
    hsdp: bool = False,
    unit_size: int = 0,
    edits: bool = False,
) -> dict | None:
    """Train every (kind, strategy) on this rank's slice; with ``hsdp``, on a
    (dp_outer=2, dp_shard=world/2) mesh with the outer dim replicating; ``unit_size``:
    unit coalescing (``suggested_communication_unit_size``); ``edits``: with
    ``edit_groups``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    results = {}
    for kind in kinds:
        for strategy in strategies:
            module = build(kind)
            opts = optimizers(kind, module)
            mesh = {}
            if hsdp:
                mesh = {
                    "device_mesh": build_device_mesh(dp_outer=2, dp_shard=world // 2).device_mesh,
                    "dp_shard_dim": "dp_shard",
                    "dp_outer_dim": "dp_outer",
                }
            model, opts = fully_shard(
                module,
                opts if kind == "split" else opts[0],
                fsdp_unit_modules=[Layer],
                zero_dp_strategy=strategy,
                suggested_communication_unit_size=unit_size,
                **mesh,
            )
            opts = opts if isinstance(opts, list) else [opts]
            owners = {
                name: p._fsdp_whole_owner
                for name, p in model.buffer.views.optimizer_named_parameters()
                if hasattr(p, "_fsdp_whole_owner")
            }
            losses, norms, moved = [], [], []
            for step in range(steps):
                if edits:
                    edit_groups(opts, step, moved)
                x, y = batch(step)
                loss = F.mse_loss(model(x[mine]), y[mine])
                loss.backward()
                # Whole-placed gradients live on their owners only: the wrapper's norm.
                norms.append(float(model.clip_grad_norm_(NO_CLIP)))
                for opt in opts:
                    opt.step()
                for opt in opts:
                    opt.zero_grad()
                total = loss.detach().clone()
                dist.all_reduce(total)
                losses.append(total.item() / world)
            params = {
                name: model.buffer.views.full_parameter(name)
                for name, *_ in model.buffer.named_params()
            }
            results[(kind, strategy)] = {
                "losses": losses,
                "norms": norms,
                "params": params,
                "owners": owners,
                "units_per_group": max(len(g.coalesced_unit_ids) for g in model.buffer.groups),
            }
    return results if rank == 0 else None


def _check(got: dict, ref: dict, where: str) -> None:
    assert_same_training(got, ref, where=where)
    assert_losses_close(got["norms"], ref["norms"], where=f"{where} norms")


@pytest.mark.parametrize("world", [2, 4])
def test_muon_parity_every_strategy(world):
    kinds = ("muon", "split", "adafactor")
    results = run_distributed(_train, world, args=(kinds,), timeout=300)[0]
    for kind in kinds:
        ref = reference(kind, world)
        assert ref["losses"][-2] < 0.9 * ref["losses"][0], (kind, ref["losses"])
        for strategy in STRATEGIES:
            got = results[(kind, strategy)]
            where = f"{kind} world={world} zero={strategy}"
            _check(got, ref, where)
            # Every matrix Muon steps is whole-placed, on every rank (by bytes: each rank
            # owns some at world size 4 although a unit has two).
            muon_names = [n for n in ref["params"] if is_hidden_matrix(n, ref["params"][n])]
            if kind == "muon":
                muon_names = list(ref["params"])
            if kind == "adafactor":  # per-tensor RMS: every parameter is placed whole
                muon_names = list(ref["params"])
            assert sorted(got["owners"]) == sorted(muon_names), where
            assert set(got["owners"].values()) == set(range(world)), where


def test_muon_parity_with_coalesced_units():
    """Units coalesced into one bucket: owners are balanced over every unit's matrices
    (less padding), and the step is still one process's."""
    kinds = ("muon", "split")
    results = run_distributed(_train, 4, args=(kinds, (3, 1), STEPS, False, 1 << 20), timeout=300)[
        0
    ]
    for kind in kinds:
        ref = reference(kind, 4)
        for strategy in (3, 1):
            got = results[(kind, strategy)]
            _check(got, ref, f"{kind} coalesced zero={strategy}")
            assert got["units_per_group"] > 1, got["units_per_group"]  # coalescing ran
            assert set(got["owners"].values()) == set(range(4)), (kind, strategy)


def test_muon_parity_hsdp():
    """HSDP (dp_outer=2 replicating, dp_shard=2): matrices are whole on one rank of each
    shard group, and the outer all-reduce keeps the replicas equal."""
    kinds = ("muon", "split")
    results = run_distributed(_train, 4, args=(kinds, STRATEGIES, STEPS, True), timeout=300)[0]
    for kind in kinds:
        for strategy in STRATEGIES:
            got = results[(kind, strategy)]
            _check(got, reference(kind, 4, pairwise=True), f"hsdp {kind} zero={strategy}")
            assert set(got["owners"].values()) == {0, 1}


def test_muon_parity_when_param_groups_change():
    """The tensors fsdp swaps in for Muon's step follow the user's edits of its param
    groups (a matrix popped in place, then added back in a new group): still one
    process's step."""
    results = run_distributed(
        _train, 2, args=(("split",), STRATEGIES, STEPS, False, 0, True), timeout=300
    )[0]
    ref = reference("split", 2, edits=True)
    moved = next(n for n in ref["params"] if is_hidden_matrix(n, ref["params"][n]))
    assert not torch.equal(ref["params"][moved], reference("split", 2)["params"][moved])
    for strategy in STRATEGIES:
        _check(results[("split", strategy)], ref, f"edited groups zero={strategy}")


def _refusals() -> None:
    module = build("split")
    muon, adamw = optimizers("split", module)
    with pytest.raises(ValueError, match="is in optimizers 0 and 1"):
        fully_shard(module, [muon, torch.optim.AdamW(module.parameters())])
    model, (muon, adamw) = fully_shard(module, [muon, adamw], fsdp_unit_modules=[Layer])
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    muon.step()
    with pytest.raises(RuntimeError, match="before the next forward"):
        model(x)
    with pytest.raises(RuntimeError, match="stepped twice"):
        muon.step()
    adamw.step()
    model(x)  # every optimizer stepped: the weights are installed
    assert adamw.state_dict()["state"]  # AdamW steps row shards only: DTensor state as usual
    # Without fully_shard's marks, Muon on row shards is refused; marked, it is taken.
    from fsdp_buffers import fsdp_whole_placement
    from fsdp_hooks import fully_shard_model, fully_shard_optimizer

    plain = build("muon")
    model = fully_shard_model(plain, fsdp_unit_modules=[Layer])
    with pytest.raises(TypeError, match="fsdp_whole_placement"):
        fully_shard_optimizer(torch.optim.Muon(model.parameters()))
    marked = build("muon")
    fsdp_whole_placement(marked.parameters())
    model = fully_shard_model(marked, fsdp_unit_modules=[Layer])
    opt = fully_shard_optimizer(torch.optim.Muon(model.parameters()))
    F.mse_loss(model(x), y).backward()
    opt.step()


def test_refusals_and_marking():
    run_distributed(_refusals, 2, timeout=120)


def _train_bf16(strategies: tuple[int, ...]) -> dict | None:
    """bf16 compute with fp32 main weights (the default policy): the whole matrices live in
    the separate main-weight buffers, sharded from ZeRO-1 on."""
    from fsdp_buffers import MixedPrecisionPolicy

    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    out = {}
    for strategy in strategies:
        module = build("split").to(torch.bfloat16)
        model, opts = fully_shard(
            module,
            optimizers("split", module),
            fsdp_unit_modules=[Layer],
            zero_dp_strategy=strategy,
            mixed_precision_policy=MixedPrecisionPolicy(),
        )
        losses = []
        for step in range(STEPS):
            x, y = batch(step)
            loss = F.mse_loss(model(x[mine].bfloat16()).float(), y[mine])
            loss.backward()
            for opt in opts:
                opt.step()
            for opt in opts:
                opt.zero_grad()
            losses.append(loss.item())
        params = {
            name: model.buffer.views.full_parameter(name)
            for name, *_ in model.buffer.named_params()
        }
        out[strategy] = {"losses": losses, "params": params}
    return out if rank == 0 else None


def test_bf16_main_weights_match_no_shard():
    """ZeRO-1/2/3 (whole-placed fp32 main weights) step exactly as ZeRO-0 (every rank
    holds everything) on the same bf16 model: same reduction, same optimizer math."""
    results = run_distributed(_train_bf16, 2, args=((0, 1, 2, 3),), timeout=300)[0]
    for strategy in (1, 2, 3):
        got, ref = results[strategy], results[0]
        assert got["losses"] == ref["losses"], strategy
        for name, value in ref["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=0)


def _meta_init() -> None:
    full = {}
    for meta in (False, True):
        torch.manual_seed(0)
        if meta:
            with torch.device("meta"):
                module = Net(bias=False)
        else:
            module = Net(bias=False)
        model, opt = fully_shard(
            module,
            torch.optim.Muon(module.parameters(), lr=MUON_LR),
            fsdp_unit_modules=[Layer],
            init_model_with_meta_device=meta,
        )
        x, y = batch(0)
        F.mse_loss(model(x), y).backward()
        opt.step()
        full[meta] = {
            n: model.buffer.views.full_parameter(n) for n, *_ in model.buffer.named_params()
        }
    for name, value in full[False].items():
        torch.testing.assert_close(full[True][name], value, rtol=0, atol=0)


def test_meta_device_init_places_whole():
    """A model built on the meta device materializes its whole-placed matrices as the eager
    construction does (each rank keeps what it owns)."""
    run_distributed(_meta_init, 2, timeout=120)


def _torch_tools() -> None:
    """torch's own tools on the parameters of a Muon-trained model: either right, or the
    same clear error on every rank (each rank reaches every check: a rank that did not
    raise would fail or hang the others)."""
    module = build("split")
    n_elements = sum(p.numel() for p in module.parameters())
    model, (muon, adamw) = fully_shard(
        module, optimizers("split", module), fsdp_unit_modules=[Layer]
    )
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    params = dict(model.named_parameters())
    whole = {n: p for n, p in params.items() if is_hidden_matrix(n, p)}
    assert whole and all(type(p).__name__ == "WholeParameter" for p in whole.values())
    # Metadata as a DTensor shows it: the global shape, numel and the buffer's device.
    assert sum(p.numel() for p in params.values()) == n_elements
    assert all(p.device == torch.device("cpu") and p.ndim == 2 for p in whole.values())
    # The optimizers hold the model's parameter objects, as under FSDP2, and every rank
    # shows a gradient for each (an owner's is no different from the others').
    assert [id(p) for p in muon.param_groups[0]["params"]] == [id(p) for p in whole.values()]
    assert all(p.grad is not None for p in whole.values())
    name, p = next(iter(whole.items()))
    for what, call in [
        ("clip_grad_norm_", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)),
        ("full_tensor", lambda: p.full_tensor()),
        ("mean", lambda: p.mean()),
        ("mul_", lambda: p.detach().mul_(2.0)),
        ("data", lambda: p.data),
        ("grad", lambda: p.grad.norm()),
    ]:
        with pytest.raises(RuntimeError, match=f"{name} of shape .* is placed whole on rank"):
            call()
        assert what  # named for the failure report
    # The wrapper's tools are right (test_muon_parity_every_strategy checks the values).
    model.clip_grad_norm_(1.0)
    muon.step()
    adamw.step()
    assert [id(p) for p in muon.param_groups[0]["params"]] == [id(p) for p in whole.values()]
    assert all(p in muon.state or p.grad is not None for p in whole.values())
    # torch's state-dict helpers see the row placement's DTensors (test_checkpoint_*).
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor, Shard

    msd = get_model_state_dict(model)
    assert all(isinstance(msd[n], DTensor) and msd[n].placements == (Shard(0),) for n in whole)
    osd = get_optimizer_state_dict(model, muon)
    assert sorted(osd["state"]) == sorted(whole)
    assert all(isinstance(s["momentum_buffer"], DTensor) for s in osd["state"].values())
    muon.zero_grad()
    assert all(p.grad is None for p in whole.values())  # set_to_none, as torch does
    model.reset_comm_stats()
    F.mse_loss(model(x), y).backward()
    assert all(p.grad is not None for p in whole.values())
    # comm_stats() reports the packing's imbalance: the padding the reduce-scatters moved.
    stats = model.comm_stats()["reduce_scatter"]
    layouts = [b.layout for b in model.buffer.buckets if b.sharding.main_weights]
    assert stats["padding_bytes"] == 4 * sum(lay.padding_numel for lay in layouts) > 0


def test_torch_tools_on_whole_parameters_raise_on_every_rank():
    run_distributed(_torch_tools, 2, timeout=120)


def _steps(model, opts, start: int, stop: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    losses = []
    for step in range(start, stop):
        x, y = batch(step)
        loss = F.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _wrap(kind: str, strategy: int):
    module = build(kind)
    opts = optimizers(kind, module)
    model, opts = fully_shard(
        module,
        opts if kind == "split" else opts[0],
        fsdp_unit_modules=[Layer],
        zero_dp_strategy=strategy,
    )
    return model, opts if isinstance(opts, list) else [opts]


def _save(directory: str, half: int) -> None:
    """ZeRO-3: train ``half`` steps, then save the split (Muon + AdamW) model with
    plain DCP and the Muon-only one with fsdp_ckpt."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard

    import fsdp_ckpt

    rank = dist.get_rank()
    model, (muon, adamw) = _wrap("split", 3)
    _steps(model, [muon, adamw], 0, half)
    sd = model.state_dict()
    # What the row placement gives: Shard(0) DTensors of torch.chunk pieces, for the
    # whole-placed matrices and their Muon momentum too.
    plain = build("split")
    row_model = fully_shard(plain, torch.optim.AdamW(plain.parameters()))[0]
    row_sd = row_model.state_dict()
    hidden = [n for n in sd if is_hidden_matrix(n, sd[n])]
    assert hidden
    for name in hidden:
        value, row = sd[name], row_sd[name]
        assert isinstance(value, DTensor) and value.placements == (Shard(0),), name
        assert value.placements == row.placements and value.shape == row.shape, name
        assert value.to_local().shape == row.to_local().shape, name
        full = model.buffer.views.full_parameter(name)
        torch.testing.assert_close(
            value.to_local(), torch.chunk(full, dist.get_world_size())[rank], rtol=0, atol=0
        )
    osd = muon.state_dict()
    assert len(osd["state"]) == len(hidden)  # on every rank, owner or not
    for state in osd["state"].values():
        assert isinstance(state["momentum_buffer"], DTensor)
        assert state["momentum_buffer"].placements == (Shard(0),)
    dcp.save(
        {"model": sd, "muon": osd, "adamw": adamw.state_dict()},
        checkpoint_id=f"{directory}/dcp",
    )
    model, (opt,) = _wrap("muon", 3)
    _steps(model, [opt], 0, half)
    fsdp_ckpt.save_checkpoint(f"{directory}/fsdp", model, opt)


def _resume(directory: str, half: int, strategy: int) -> dict | None:
    """Another world size (and strategy): load, check the weights, train the rest."""
    import torch.distributed.checkpoint as dcp

    import fsdp_ckpt

    results = {}
    model, (muon, adamw) = _wrap("split", strategy)
    sd = {"model": model.state_dict(), "muon": muon.state_dict(), "adamw": adamw.state_dict()}
    dcp.load(sd, checkpoint_id=f"{directory}/dcp")
    model.load_state_dict(sd["model"])
    muon.load_state_dict(sd["muon"])
    adamw.load_state_dict(sd["adamw"])
    losses = _steps(model, [muon, adamw], half, STEPS)
    results["split"] = (losses, model.buffer.views.full_parameters())
    model, (opt,) = _wrap("muon", strategy)
    fsdp_ckpt.load_checkpoint(f"{directory}/fsdp", model, opt)
    losses = _steps(model, [opt], half, STEPS)
    results["muon"] = (losses, model.buffer.views.full_parameters())
    return results if dist.get_rank() == 0 else None


@pytest.mark.parametrize("strategy", [3, 1])
def test_checkpoint_reshards_across_world_sizes(tmp_path, strategy):
    """Saved under whole placement at world size 4 (plain DCP of the state dicts, and
    fsdp_ckpt), loaded at world size 2 (other owners, other pieces) under ZeRO-3 or
    ZeRO-1, training goes on as one process would (Muon's momentum and AdamW's moments
    carried over). World 4 -> 2: the reference sums 2 slices in gloo's order after the
    load; loaded 2 -> 4, gloo's ring order flips one bf16 rounding of Muon's Newton-Schulz
    (measured: one matrix 1.8e-4 off, losses within 1e-7; see MUON_LR), and a same-world
    resume is exact."""
    half = STEPS // 2
    run_distributed(_save, 4, args=(str(tmp_path), half), timeout=180)
    got = run_distributed(_resume, 2, args=(str(tmp_path), half, strategy), timeout=180)[0]
    for kind in ("split", "muon"):
        ref = reference(kind, 4, resumed=(half, 2))
        losses, params = got[kind]
        assert_losses_close(losses, ref["losses"][half:], where=kind)
        for name, value in ref["params"].items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _padding_warnings(unit_size: int) -> list[str]:
    """The whole-placement padding warnings of wrapping four bias-free 32x32 units for
    Muon at this world size, one unit per bucket or coalesced into one."""
    import warnings

    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(4)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fully_shard(
            module,
            torch.optim.Muon(module.parameters(), lr=1e-3),
            fsdp_unit_modules=[nn.Linear],
            zero_dp_strategy=3,
            suggested_communication_unit_size=unit_size,
        )
    return [str(w.message) for w in caught if "whole placement" in str(w.message)]


def test_wrap_warns_when_whole_placement_pads():
    """A bucket with one matrix at four ranks moves 4x its elements (each rank's shard is
    one whole matrix): the wrap says so on every rank; four matrices in one bucket
    (coalesced) pad nothing and say nothing."""
    for rank_warnings in run_distributed(_padding_warnings, 4, args=(0,), timeout=120):
        assert len(rank_warnings) == 1 and "4.00x" in rank_warnings[0], rank_warnings
    for rank_warnings in run_distributed(_padding_warnings, 4, args=(1 << 16,), timeout=120):
        assert rank_warnings == [], rank_warnings
