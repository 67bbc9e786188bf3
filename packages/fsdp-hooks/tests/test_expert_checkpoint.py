"""Checkpoints of expert-parallel models: the toy MoE of ``test_expert.py`` (world size
4, its 4 experts split across 2 expert-parallel ranks) names its experts by their
global index in state dicts, so a checkpoint holds each once, as a one-process model
with every expert names it.

One run trains 3 steps (ZeRO-3, SGD with momentum) and saves; a fresh model under
ZeRO-1 loads the checkpoint and trains on, as does one with 4 expert-parallel ranks
(1 expert each): both must reproduce an uninterrupted one-process run. The checkpoint
consolidates offline (and the running model online) into the state dict of the plain
``Net`` with every expert.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from fsdp_hooks import fully_shard, fully_shard_model
from fsdp_hooks.features import expert_names
from fsdp_hooks.features.expert_names import ExpertStateNames, LocalExperts, global_expert_ids
from fsdp_mesh import build_device_mesh
from fsdp_mesh.testing import mean_over_ranks, run_distributed


def _load_toy():
    """``test_expert.py`` as a module (test files are not importable by name here)."""
    name = "_fsdp_toy_moe"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).with_name("test_expert.py")
        )
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


toy = _load_toy()
WORLD, EP, STEPS, MORE = toy.WORLD, toy.EP, toy.STEPS, 2


def _optimizer(params):
    return torch.optim.SGD(params, lr=toy.LR, momentum=0.9)


def _reference():
    torch.manual_seed(0)
    net = toy.Net()
    opt = _optimizer(net.parameters())
    losses = []
    for step in range(STEPS + MORE):
        x, y = toy._batch(step)
        loss = F.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _model(ep, strategy, seed):
    """The toy model with ``ep`` expert-parallel ranks, seeded with ``seed`` (not the
    reference's: loading must overwrite everything). Experts are not assigned by the
    contiguous rule, so their ids must be read from the model: interleaved with 2
    ranks (``expert_ids`` on the MoE), reversed with 4 (Megatron-Core's
    ``local_expert_indices``, here on the ModuleList)."""
    meshes = build_device_mesh(dp_shard=WORLD, expert_parallel=ep)
    ep_mesh = meshes.expt_device_mesh["ep"]
    ep_rank, local = ep_mesh.get_local_rank(), toy.N_EXPERTS // ep
    ids = [ep_rank + ep * i for i in range(local)] if ep == EP else [ep - 1 - ep_rank]
    torch.manual_seed(seed)
    net = toy.Net()
    net.moe.experts = nn.ModuleList(net.moe.experts[i] for i in ids)
    net.moe.expert_ids = ids  # what forward routes by
    if ep != EP:
        net.moe.experts.local_expert_indices = ids
    net.moe.group = ep_mesh.get_group()
    model, opt = fully_shard(
        net,
        _optimizer(net.parameters()),
        **meshes.fsdp_kwargs(),
        fsdp_unit_modules=[toy.MoE],
        zero_dp_strategy=strategy,
    )
    return model, opt, ids


def _contiguous_ids(model):
    """The ids the contiguous rule gives a model that carries none (a collective)."""
    net = toy.Net()
    net.moe.experts = nn.ModuleList(net.moe.experts[:2])
    del net.moe.expert_ids
    names = [n for n, _ in net.named_parameters() if n.startswith("moe.experts.")]
    return ExpertStateNames.build(net, names, model.dist_index).ids


def _steps(model, opt, start, stop):
    rank, n = dist.get_rank(), toy.TOKENS
    losses = []
    for step in range(start, stop):
        x, y = toy._batch(step)
        loss = F.mse_loss(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
    return losses


def _params(model, ids):
    return {toy._global_name(n, ids): t for n, t in model.buffer.views.full_parameters().items()}


def _foreign_expert_refused(model, ids):
    """Another rank's expert whose global index is one of this rank's local indices
    must not land on the local expert of that index."""
    sd = model.state_dict()
    other = next(i for i in range(len(ids)) if i not in ids)
    key, mine = f"moe.experts.{other}.w1.weight", f"moe.experts.{ids[other]}.w1.weight"
    before = sd[mine].to_local().clone()
    result = model.load_state_dict({**sd, key: torch.zeros_like(sd[mine])}, strict=False)
    try:
        model.load_state_dict({**sd, key: sd[mine]})
    except RuntimeError as err:
        strict_error = str(err)
    else:
        strict_error = None
    return {
        "unexpected": list(result.unexpected_keys),
        "missing": list(result.missing_keys),
        "key": key,
        "kept": torch.equal(model.state_dict()[mine].to_local(), before),
        "strict_error": strict_error,
    }


def _grouped_error():
    """Grouped expert weights (one 3-D tensor): no per-expert name to renumber."""
    torch.manual_seed(0)
    net = nn.Module()
    net.inp = nn.Linear(4, 4)
    net.experts = nn.Module()
    net.experts.weight = nn.Parameter(torch.randn(2, 4, 4))
    model = fully_shard_model(
        net, **build_device_mesh(dp_shard=WORLD, expert_parallel=EP).fsdp_kwargs()
    )
    try:
        model.state_dict()
    except NotImplementedError as err:
        return str(err)
    return None


def _job(ckpt_dir):
    from fsdp_ckpt import (
        get_full_model_state_dict,
        get_optimizer_state_dict,
        load_checkpoint,
        save_checkpoint,
    )

    out = {}
    model, opt, ids = _model(EP, 3, seed=0)
    out["ids"] = ids
    out["losses"] = _steps(model, opt, 0, STEPS)
    out["params"] = _params(model, ids)
    sd = model.state_dict()
    out["keys"] = {k: (isinstance(v, DTensor) and v.device_mesh.size()) for k, v in sd.items()}
    osd = get_optimizer_state_dict(model, opt)
    out["optim_keys"] = sorted(osd["state"])
    out["group_names"] = [g["params"] for g in osd["param_groups"]]
    save_checkpoint(ckpt_dir, model, opt, extra={"step": STEPS})
    out["online"] = get_full_model_state_dict(model)
    out["online_all"] = get_full_model_state_dict(model, rank0_only=False)
    out["foreign"] = _foreign_expert_refused(model, ids)
    out["contiguous"] = _contiguous_ids(model)

    model, opt, ids = _model(EP, 1, seed=1)  # another strategy
    assert load_checkpoint(ckpt_dir, model, opt) == {"step": STEPS}
    out["resumed"] = _steps(model, opt, STEPS, STEPS + MORE)

    model, opt, ids = _model(WORLD, 3, seed=2)  # 1 expert per rank
    assert load_checkpoint(ckpt_dir, model, opt) == {"step": STEPS}
    out["ep4_params"] = _params(model, ids)
    out["ep4_resumed"] = _steps(model, opt, STEPS, STEPS + MORE)
    out["grouped"] = _grouped_error()
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    ckpt_dir = tmp_path_factory.mktemp("moe_ckpt") / "ckpt"
    return ckpt_dir, run_distributed(_job, WORLD, args=(str(ckpt_dir),), timeout=120)


def _trained(results):
    merged = {}
    for out in results:
        merged.update(out["params"])
    assert set(merged) == set(toy.Net().state_dict())
    return merged


def _assert_equal(got, want, what):
    assert set(got) == set(want), what
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{what}: {name}"


# ---- tests ---------------------------------------------------------------------------


def test_state_dicts_name_experts_globally(world4):
    dense = {k for k in toy.Net().state_dict() if not k.startswith("moe.experts.")}
    every = set(toy.Net().state_dict())
    for out in world4[1]:
        experts = {f"moe.experts.{i}.{p}" for i in out["ids"] for p in toy.Expert().state_dict()}
        assert set(out["keys"]) == dense | experts
        for key, mesh_size in out["keys"].items():  # experts on the expert data-parallel mesh
            assert mesh_size == (WORLD // EP if key in experts else WORLD), key
        assert set(out["optim_keys"]) == dense | experts
        assert [set(names) for names in out["group_names"]] == [every]  # every rank's


def test_resume_under_other_strategy_and_ep_size_matches_one_process(world4):
    ref = _reference()
    for out in world4[1]:
        torch.testing.assert_close(out["losses"], ref[:STEPS], rtol=1e-5, atol=0)
        torch.testing.assert_close(out["resumed"], ref[STEPS:], rtol=1e-5, atol=0)
        torch.testing.assert_close(out["ep4_resumed"], ref[STEPS:], rtol=1e-5, atol=0)


def test_other_ep_size_loads_every_expert(world4):
    results = world4[1]
    merged = {}
    for out in results:
        merged.update(out["ep4_params"])
    _assert_equal(merged, _trained(results), "EP=4 after loading")


def test_consolidates_offline_and_online(world4, tmp_path):
    from fsdp_ckpt import consolidate_checkpoint, load_full_state_dict

    ckpt_dir, results = world4
    trained = _trained(results)
    consolidate_checkpoint(ckpt_dir, tmp_path / "full.pt")
    full = load_full_state_dict(tmp_path / "full.pt")
    net = toy.Net()
    net.load_state_dict(full)  # strict: every expert, nothing else
    _assert_equal(dict(net.state_dict()), trained, "offline")
    _assert_equal(results[0]["online"], trained, "online, rank 0")
    assert all(out["online"] == {} for out in results[1:])
    for out in results:
        _assert_equal(out["online_all"], trained, "online, every rank")


def test_other_ranks_experts_are_unexpected_keys(world4):
    for out in world4[1]:
        foreign = out["foreign"]
        assert foreign["unexpected"] == [foreign["key"]] and foreign["missing"] == []
        assert foreign["kept"]
        assert foreign["strict_error"] is not None and foreign["key"] in foreign["strict_error"]


def test_grouped_expert_weights_are_refused_by_name(world4):
    for out in world4[1]:
        assert out["grouped"] is not None and "experts.weight" in out["grouped"]


def test_contiguous_rule_without_ids(world4):
    for rank, out in enumerate(world4[1]):
        ep_rank = rank % EP  # mesh (dp_shard // EP, EP): expert-parallel ranks adjacent
        assert out["contiguous"] == {"moe.experts": (2 * ep_rank, 2 * ep_rank + 1)}


def test_fsdp_ckpt_reads_the_attribute_fsdp_hooks_sets():
    from fsdp_ckpt import names

    assert names.STATE_KEYS_ATTR == expert_names.STATE_KEYS_ATTR


def test_global_expert_ids_rule():
    def ranks(*lists, ep=(0, 1)):
        return [LocalExperts(e, {"moe.experts": lst}) for e, lst in zip(ep, lists, strict=True)]

    contiguous = global_expert_ids(ranks((2, None), (2, None)), ep_size=2)
    assert [r["moe.experts"] for r in contiguous] == [(0, 1), (2, 3)]
    given = global_expert_ids(ranks((2, (3, 1)), (2, (0, 2))), ep_size=2)
    assert [r["moe.experts"] for r in given] == [(3, 1), (0, 2)]
    bad = {
        "same number everywhere": ranks((2, None), (3, None)),
        "expected 2 disjoint sets": ranks((2, (0, 1)), (2, (0, 1))),
        "expected 2 distinct ids": ranks((2, (0, 0)), (2, (1, 2))),
        "expert-parallel rank": ranks((2, None), (2, None), ep=(None, None)),
    }
    for message, everyone in bad.items():
        with pytest.raises(ValueError, match=message):
            global_expert_ids(everyone, ep_size=2)
