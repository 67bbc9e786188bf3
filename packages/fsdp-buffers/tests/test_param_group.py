"""Grouping parameters into buckets: unit x dtype x requires_grad x no_shard, bucket sizes,
tied parameters, integer parameters, and resolving FSDP unit classes (single process)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from fsdp_buffers import fsdp_no_shard
from fsdp_buffers.param_group import (
    find_fsdp_units,
    group_parameters,
    resolve_unit_classes,
    tied_parameter_names,
)


class Block(nn.Module):
    def __init__(self, d: int = 4, half: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        if half:  # a bf16 submodule inside a unit: its own group within the unit
            self.half = nn.Linear(d, d, dtype=torch.bfloat16)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)  # outside every unit
        self.blocks = nn.ModuleList([Block(), Block(half=True)])
        self.bf16 = nn.Linear(4, 4, dtype=torch.bfloat16)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.vit = fsdp_no_shard(nn.Linear(4, 4))
        self.out = nn.Linear(4, 2)  # outside every unit, same key as inp


UNIT_NAMES = ("lin.weight", "lin.bias", "norm.weight", "norm.bias")


def _summary(groups):
    return [
        (g.fsdp_unit_id, g.dtype, g.requires_grad, g.fsdp_no_shard, tuple(g.names)) for g in groups
    ]


def test_groups_by_unit_dtype_requires_grad_and_no_shard():
    net = Net()
    groups, units = group_parameters(net, [Block])
    assert units == ["blocks.0", "blocks.1"]
    f32, bf16 = torch.float32, torch.bfloat16
    assert _summary(groups) == [
        (None, f32, True, False, ("inp.weight", "inp.bias", "out.weight", "out.bias")),
        (0, f32, True, False, tuple(f"blocks.0.{n}" for n in UNIT_NAMES)),
        (1, f32, True, False, tuple(f"blocks.1.{n}" for n in UNIT_NAMES)),
        (1, bf16, True, False, ("blocks.1.half.weight", "blocks.1.half.bias")),
        (None, bf16, True, False, ("bf16.weight", "bf16.bias")),
        (None, f32, False, False, ("frozen.weight", "frozen.bias")),
        (None, f32, True, True, ("vit.weight", "vit.bias")),
    ]  # fmt: skip
    # The groups hold the parameter objects themselves, each exactly once.
    named = dict(net.named_parameters())
    for g in groups:
        assert all(p is named[n] for n, p in zip(g.names, g.params, strict=True))
        assert g.numel == sum(p.numel() for p in g.params)
    assert sum(len(g.params) for g in groups) == len(named)


def test_no_units_puts_everything_in_non_unit_buckets():
    groups, units = group_parameters(Net())
    assert units == []
    assert all(g.fsdp_unit_id is None for g in groups)
    # fp32 trainable (inp, both blocks, out), bf16 (blocks.1.half, bf16), frozen, vit.
    assert [len(g.params) for g in groups] == [12, 4, 2, 2]


def test_nested_units_belong_to_the_outermost():
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()
            self.lin = nn.Linear(4, 4)

    net = nn.Sequential(Outer(), Block())
    assert find_fsdp_units(net, [Outer, Block]) == ["0", "1"]
    groups, _ = group_parameters(net, [Outer, Block])
    assert [(g.fsdp_unit_id, len(g.params)) for g in groups] == [(0, 6), (1, 4)]
    # The root itself as a unit owns everything.
    assert find_fsdp_units(net, [nn.Sequential, Block]) == [""]


def _chain(sizes):
    """A model whose non-unit fp32 parameters have the given numels, in order."""
    net = nn.Module()
    for i, n in enumerate(sizes):
        net.register_parameter(f"p{i}", nn.Parameter(torch.zeros(n)))
    return net


def test_bucket_size_splits_non_unit_params_greedily():
    sizes = [12, 4, 12, 4, 8, 2, 30, 1]
    groups, _ = group_parameters(_chain(sizes), bucket_size=20)
    assert [[p.numel() for p in g.params] for g in groups] == [[12, 4], [12, 4], [8, 2], [30], [1]]
    for g, nxt in itertools.pairwise(groups):
        assert g.numel <= 20 or len(g.params) == 1  # never above, unless one param is
        assert g.numel + nxt.params[0].numel() > 20  # a bucket closes only when full
    # Names stay in order across buckets.
    assert [n for g in groups for n in g.names] == [f"p{i}" for i in range(len(sizes))]


def test_bucket_size_does_not_split_units_or_mix_keys():
    net = Net()
    groups, _ = group_parameters(net, [Block], bucket_size=10)
    # Each unit's fp32 params (4*4+4+4+4 = 28 elements) stay one bucket.
    unit_groups = [g for g in groups if g.fsdp_unit_id is not None and g.dtype == torch.float32]
    assert [g.numel for g in unit_groups] == [28, 28]
    # Non-unit buckets: inp (3*4+4=16) alone, out (8+2=10) alone under 10 elements.
    non_unit_f32 = [
        g.names
        for g in groups
        if g.fsdp_unit_id is None and g.dtype == torch.float32 and g.requires_grad
        and not g.fsdp_no_shard
    ]  # fmt: skip
    assert non_unit_f32 == [["inp.weight"], ["inp.bias"], ["out.weight", "out.bias"]]


def test_disable_bucketing_gives_one_bucket_per_key():
    sizes = [12, 4, 12, 4, 8, 2, 30, 1]
    groups, _ = group_parameters(_chain(sizes), bucket_size=20, disable_bucketing=True)
    assert len(groups) == 1 and groups[0].numel == sum(sizes)
    groups, _ = group_parameters(Net(), [Block], bucket_size=1, disable_bucketing=True)
    assert len(groups) == 7  # same as the default: one per (unit, dtype, rg, no_shard) key


def test_bad_bucket_size():
    with pytest.raises(ValueError, match="bucket_size must be a positive number of elements"):
        group_parameters(_chain([3]), bucket_size=0)


def test_shared_parameter_is_grouped_once_and_aliases_are_listed():
    net = nn.Module()
    net.a = nn.Linear(4, 4)
    net.mid = nn.Linear(4, 4)
    net.b = nn.Linear(4, 4)
    net.b.weight = net.a.weight
    groups, _ = group_parameters(net)
    params = [p for g in groups for p in g.params]
    assert len(params) == len({id(p) for p in params}) == 5
    assert groups[0].names == ["a.weight", "a.bias", "mid.weight", "mid.bias", "b.bias"]
    assert tied_parameter_names(net) == {"a.weight": ["b.weight"]}
    assert tied_parameter_names(Net()) == {}


def test_shared_parameter_across_unit_boundary_goes_to_the_first_unit():
    net = nn.Module()
    net.blocks = nn.ModuleList([Block(), Block()])
    net.blocks[1].lin.weight = net.blocks[0].lin.weight
    groups, _ = group_parameters(net, [Block])
    assert "blocks.0.lin.weight" in groups[0].names
    assert all("blocks.1.lin.weight" not in g.names for g in groups)
    assert tied_parameter_names(net) == {"blocks.0.lin.weight": ["blocks.1.lin.weight"]}


def test_integer_parameter_is_replicated_and_frozen():
    net = nn.Module()
    net.lin = nn.Linear(2, 2)
    net.count = nn.Parameter(torch.arange(5), requires_grad=False)
    groups, _ = group_parameters(net)
    (int_group,) = [g for g in groups if g.dtype == torch.int64]
    assert int_group.names == ["count"]
    assert int_group.fsdp_no_shard and not int_group.requires_grad and not int_group.is_float
    (float_group,) = [g for g in groups if g.dtype == torch.float32]
    assert not float_group.fsdp_no_shard and float_group.requires_grad


def test_expert_params_get_their_own_group():
    net = nn.Module()
    net.dense = nn.Linear(2, 2)
    net.expert = nn.Linear(2, 2)
    groups, _ = group_parameters(net, is_expert_param=lambda name, p: name.startswith("expert"))
    assert [(g.is_expert_param, g.names) for g in groups] == [
        (False, ["dense.weight", "dense.bias"]),
        (True, ["expert.weight", "expert.bias"]),
    ]


def test_resolve_unit_classes_accepts_classes_and_dotted_paths():
    net = Net()
    assert resolve_unit_classes(None, net) == ()
    assert resolve_unit_classes([Block, "torch.nn.LayerNorm"], net) == (Block, nn.LayerNorm)
    assert resolve_unit_classes(["torch.nn.modules.linear.Linear"], net) == (nn.Linear,)
    # A subclass present in the model matches its base class.
    assert resolve_unit_classes([nn.Module], net) == (nn.Module,)


def test_resolve_unit_classes_rejects_a_class_matching_nothing():
    with pytest.raises(ValueError, match=r"torch\.nn\.modules\.conv\.Conv2d matches no") as info:
        resolve_unit_classes([Block, nn.Conv2d], Net())
    message = str(info.value)
    for present in ("torch.nn.modules.linear.Linear", "torch.nn.modules.normalization.LayerNorm"):
        assert present in message
    assert f"{Block.__module__}.Block" in message
    with pytest.raises(ValueError, match=r"torch\.nn\.modules\.conv\.Conv1d matches no"):
        resolve_unit_classes(["torch.nn.Conv1d"], Net())


def test_resolve_unit_classes_rejects_bad_specs():
    net = Net()
    with pytest.raises(ValueError, match=r"must be a dotted path"):
        resolve_unit_classes(["Block"], net)
    with pytest.raises(ValueError, match=r"cannot import FSDP unit class 'torch.nn.NoSuchBlock'"):
        resolve_unit_classes(["torch.nn.NoSuchBlock"], net)
    with pytest.raises(ValueError, match=r"cannot import FSDP unit class 'no_such_pkg.Block'"):
        resolve_unit_classes(["no_such_pkg.Block"], net)
    with pytest.raises(TypeError, match=r"not an nn.Module subclass"):
        resolve_unit_classes(["torch.zeros"], net)
    with pytest.raises(TypeError, match=r"nn.Module subclasses or dotted class paths"):
        resolve_unit_classes([42], net)
    with pytest.raises(TypeError, match=r"nn.Module subclasses or dotted class paths"):
        resolve_unit_classes([int], net)


def test_scalar_parameter_is_replicated_but_trained():
    # A DTensor cannot be Shard(0) of a 0-d tensor, so a learnable scale stays replicated.
    net = nn.Module()
    net.lin = nn.Linear(2, 2)
    net.scale = nn.Parameter(torch.tensor(1.5))
    groups, _ = group_parameters(net)
    assert [(g.names, g.fsdp_no_shard, g.requires_grad) for g in groups] == [
        (["scale"], True, True),  # a module's own parameters come before its children's
        (["lin.weight", "lin.bias"], False, True),
    ]
