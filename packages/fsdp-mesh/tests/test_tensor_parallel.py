"""Megatron-Core tensor-parallel attribute helpers."""

import pytest
import torch

from fsdp_mesh import (
    get_mcore_tensor_parallel_partition_dim,
    is_mcore_tensor_model_parallel,
    is_mcore_tensor_parallel_duplicated,
)


def _param(**attrs):
    p = torch.nn.Parameter(torch.zeros(4, 2))
    for name, value in attrs.items():
        setattr(p, name, value)
    return p


def test_plain_parameter_is_duplicated():
    # Megatron-FSDP: a parameter with no tensor-parallel marking is not split, so every
    # tensor-parallel rank holds it whole ("duplicated").
    p = _param()
    assert not is_mcore_tensor_model_parallel(p)
    assert is_mcore_tensor_parallel_duplicated(p)
    assert get_mcore_tensor_parallel_partition_dim(p) is None


@pytest.mark.parametrize(("mode", "dim"), [("column", 0), ("row", 1)])
def test_tensor_parallel_mode(mode, dim):
    # Megatron-Core's _tensor_parallel_mode comes first: column-parallel weights are
    # split along dim 0, row-parallel ones along dim 1, whatever else is set.
    p = _param(_tensor_parallel_mode=mode, tensor_model_parallel=False)
    assert is_mcore_tensor_model_parallel(p)
    assert not is_mcore_tensor_parallel_duplicated(p)
    assert get_mcore_tensor_parallel_partition_dim(p) == dim


def test_negative_partition_dim_is_not_split():
    # Megatron-FSDP reads partition_dim < 0 (Megatron-Core's -1) as not split.
    p = _param(tensor_model_parallel=True, partition_dim=-1)
    assert not is_mcore_tensor_model_parallel(p)
    assert is_mcore_tensor_parallel_duplicated(p)


def test_split_parameter():
    p = _param(tensor_model_parallel=True, partition_dim=0, partition_stride=1)
    assert is_mcore_tensor_model_parallel(p)
    assert not is_mcore_tensor_parallel_duplicated(p)
    assert get_mcore_tensor_parallel_partition_dim(p) == 0


def test_megatron_fsdp_attributes_take_precedence():
    p = _param(_mcore_tp=True, _tp_partition_dim=1, partition_dim=0)
    assert is_mcore_tensor_model_parallel(p)
    assert get_mcore_tensor_parallel_partition_dim(p) == 1


def test_duplicated_parameter():
    # Megatron-Core's default tag for weights every TP rank holds whole.
    p = _param(tensor_model_parallel=False, partition_dim=-1)
    assert not is_mcore_tensor_model_parallel(p)
    assert is_mcore_tensor_parallel_duplicated(p)
    assert get_mcore_tensor_parallel_partition_dim(p) is None
    assert is_mcore_tensor_parallel_duplicated(_param(_tp_duplicated=True))


def test_split_without_partition_dim_raises():
    with pytest.raises(ValueError, match=r"shape \(4, 2\).*no 'partition_dim'"):
        get_mcore_tensor_parallel_partition_dim(_param(tensor_model_parallel=True))
