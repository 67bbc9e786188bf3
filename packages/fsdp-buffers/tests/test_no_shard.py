import re

import pytest
import torch
from torch import nn

from fsdp_buffers.no_shard import (
    FSDP_PARAM_ATTRIBUTES,
    copy_param_attributes,
    fsdp_no_shard,
    is_fsdp_no_shard,
    module_is_fully_no_shard,
)


class Net(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.vision = nn.Sequential(nn.Linear(4, 4, device=device), nn.LayerNorm(4, device=device))
        self.head = nn.Linear(4, 2, device=device)


def test_marks_every_parameter_of_a_module_recursively_and_returns_it():
    net = Net()
    assert fsdp_no_shard(net.vision) is net.vision
    assert all(is_fsdp_no_shard(p) for p in net.vision.parameters())
    assert len(list(net.vision.parameters())) == 4
    assert not any(is_fsdp_no_shard(p) for p in net.head.parameters())
    assert all(p._fsdp_no_shard is True for p in net.vision.parameters())


def test_can_wrap_an_expression():
    net = nn.Module()
    net.vit = fsdp_no_shard(nn.Linear(2, 2))
    assert module_is_fully_no_shard(net)


def test_marks_a_single_parameter():
    # The PR's version called .parameters() on its argument and crashed here.
    layer = nn.Linear(3, 3)
    assert fsdp_no_shard(layer.bias) is layer.bias
    assert is_fsdp_no_shard(layer.bias)
    assert not is_fsdp_no_shard(layer.weight)


def test_marks_a_list_and_a_generator_of_parameters():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    params = [a.weight, b.bias]
    assert fsdp_no_shard(params) is params
    assert is_fsdp_no_shard(a.weight) and is_fsdp_no_shard(b.bias)
    assert not is_fsdp_no_shard(a.bias)
    fsdp_no_shard(b.parameters())
    assert is_fsdp_no_shard(b.weight)


def test_rejects_a_tensor_that_is_not_a_parameter():
    with pytest.raises(TypeError, match=re.escape("got a Tensor that is not an nn.Parameter")):
        fsdp_no_shard(torch.ones(2))


@pytest.mark.parametrize(
    ("value", "type_name"), [(3, "int"), (None, "NoneType"), ("weight", "str")]
)
def test_rejects_non_parameter_objects(value, type_name):
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"expects an nn.Module, an nn.Parameter, or an iterable of nn.Parameter, got {type_name}"
        ),
    ):
        fsdp_no_shard(value)


def test_rejects_an_iterable_with_a_non_parameter_before_marking_anything():
    p = nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError, match=re.escape("item 1 is a Tensor, not an nn.Parameter")):
        fsdp_no_shard([p, torch.ones(2)])
    assert not is_fsdp_no_shard(p)


def test_is_fsdp_no_shard_on_unmarked_and_plain_tensors():
    assert is_fsdp_no_shard(nn.Parameter(torch.ones(1))) is False
    assert is_fsdp_no_shard(torch.ones(1)) is False


def test_module_is_fully_no_shard():
    net = Net()
    assert not module_is_fully_no_shard(net)
    fsdp_no_shard(net.vision)
    assert module_is_fully_no_shard(net.vision)
    assert module_is_fully_no_shard(net.vision[0])
    assert not module_is_fully_no_shard(net)  # head is still sharded
    fsdp_no_shard(net.head.weight)
    assert not module_is_fully_no_shard(net.head)  # bias is not marked
    fsdp_no_shard(net.head)
    assert module_is_fully_no_shard(net)
    # No parameters: nothing is marked, so not "fully no-shard".
    assert not module_is_fully_no_shard(nn.ReLU())


def test_attribute_list_covers_megatron_core_and_contains_no_tensor_attribute():
    for name in (
        "_fsdp_no_shard",
        "tensor_model_parallel",
        "partition_dim",
        "partition_stride",
        "allreduce",
        "sequence_parallel",
        "shared",
        "is_embedding_or_output_parameter",
    ):
        assert name in FSDP_PARAM_ATTRIBUTES
    assert len(set(FSDP_PARAM_ATTRIBUTES)) == len(FSDP_PARAM_ATTRIBUTES)
    # Copying must never overwrite real Tensor attributes.
    plain = nn.Parameter(torch.ones(1))
    assert not [a for a in FSDP_PARAM_ATTRIBUTES if hasattr(plain, a)]


def test_copy_param_attributes_copies_those_present_only():
    src = nn.Parameter(torch.ones(2))
    src.tensor_model_parallel = True
    src.partition_dim = 0
    src.partition_stride = 1
    src.allreduce = False
    src.unrelated = "not copied"
    dst = nn.Parameter(torch.zeros(2))
    assert copy_param_attributes(src, dst) is dst
    assert (dst.tensor_model_parallel, dst.partition_dim, dst.partition_stride, dst.allreduce) == (
        True,
        0,
        1,
        False,
    )
    assert not hasattr(dst, "sequence_parallel")
    assert not hasattr(dst, "_fsdp_no_shard")
    assert not hasattr(dst, "unrelated")


def test_copy_param_attributes_keeps_a_frozen_parameter_frozen():
    src = nn.Parameter(torch.ones(2), requires_grad=False)
    dst = copy_param_attributes(src, nn.Parameter(torch.zeros(2)))
    assert dst.requires_grad is False


def test_copy_param_attributes_rejects_non_tensors():
    with pytest.raises(TypeError, match=re.escape("got src=str, dst=Parameter")):
        copy_param_attributes("weight", nn.Parameter(torch.ones(1)))


def test_flag_survives_meta_device_materialization():
    net = Net(device="meta")
    fsdp_no_shard(net.vision)
    net.vision[0].weight.tensor_model_parallel = True
    net.vision[0].weight.partition_dim = 0
    net.vision[1].weight.requires_grad_(False)
    old = dict(net.named_parameters())
    assert all(p.is_meta for p in old.values())

    # to_empty() swaps in new parameter objects: the Python attributes are gone.
    net.to_empty(device="cpu")
    assert not any(is_fsdp_no_shard(p) for p in net.parameters())

    # A materializer then installs fresh nn.Parameter objects, copying attributes from
    # the originals (as Megatron-FSDP does after reset_parameters()).
    for name, old_param in old.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = net.get_submodule(owner_name)
        new_param = nn.Parameter(torch.empty_like(getattr(owner, leaf), device="cpu"))
        setattr(owner, leaf, copy_param_attributes(old_param, new_param))

    params = dict(net.named_parameters())
    assert all(not p.is_meta for p in params.values())
    assert all(params[n] is not old[n] for n in old)
    assert module_is_fully_no_shard(net.vision)
    assert not any(is_fsdp_no_shard(p) for p in net.head.parameters())
    assert params["vision.0.weight"].tensor_model_parallel is True
    assert params["vision.0.weight"].partition_dim == 0
    assert params["vision.1.weight"].requires_grad is False
    assert params["vision.1.bias"].requires_grad is True
