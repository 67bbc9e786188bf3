import re

import numpy as np
import pytest

from fsdp_buffers.strategy import ShardingStrategy as S


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (S.NO_SHARD, S.NO_SHARD),
        (S.OPTIM_GRADS_PARAMS, S.OPTIM_GRADS_PARAMS),
        (0, S.NO_SHARD),
        (1, S.OPTIM),
        (2, S.OPTIM_GRADS),
        (3, S.OPTIM_GRADS_PARAMS),
        (np.int64(2), S.OPTIM_GRADS),
        ("no_shard", S.NO_SHARD),
        ("optim", S.OPTIM),
        ("optim_grads", S.OPTIM_GRADS),
        ("optim_grads_params", S.OPTIM_GRADS_PARAMS),
        ("NO_SHARD", S.NO_SHARD),
        ("Optim_Grads_Params", S.OPTIM_GRADS_PARAMS),
        ("zero1", S.OPTIM),
        ("zero2", S.OPTIM_GRADS),
        ("zero3", S.OPTIM_GRADS_PARAMS),
        ("ZeRO-3", S.OPTIM_GRADS_PARAMS),
        ("zero_2", S.OPTIM_GRADS),
        ("ZERO-1", S.OPTIM),
    ],
)
def test_parse_accepts_every_documented_spelling(value, expected):
    result = S.parse(value)
    assert result is expected
    assert type(result) is S


@pytest.mark.parametrize(
    "value",
    [
        True,
        False,
        -1,
        4,
        3.0,
        "3",
        "",
        "zero0",
        "zero4",
        "zero 3",
        "full_shard",
        " optim",
        None,
        [3],
    ],
)
def test_parse_rejects_anything_else_and_lists_allowed_values(value):
    with pytest.raises(ValueError) as info:
        S.parse(value)
    message = str(info.value)
    assert repr(value) in message
    for allowed in ("0..3", "'no_shard'", "'optim'", "'optim_grads'", "'optim_grads_params'"):
        assert allowed in message
    assert "'zero1', 'zero2', 'zero3'" in message


def test_bool_is_refused_with_a_reason():
    with pytest.raises(ValueError, match=re.escape("a bool is not a strategy")):
        S.parse(True)


def test_values_and_megatron_names_match_megatron_fsdp():
    assert [(int(s), s.megatron_name) for s in S] == [
        (0, "no_shard"),
        (1, "optim"),
        (2, "optim_grads"),
        (3, "optim_grads_params"),
    ]
    # Round trip through the Megatron name.
    assert all(S.parse(s.megatron_name) is s for s in S)


def test_what_each_strategy_shards():
    table = {s: (s.shards_main_weights, s.shards_grads, s.shards_model_weights) for s in S}
    assert table == {
        S.NO_SHARD: (False, False, False),
        S.OPTIM: (True, False, False),
        S.OPTIM_GRADS: (True, True, False),
        S.OPTIM_GRADS_PARAMS: (True, True, True),
    }


def test_compares_as_int_like_megatron_intenum():
    assert S.OPTIM_GRADS_PARAMS == 3
    assert S.OPTIM < S.OPTIM_GRADS
