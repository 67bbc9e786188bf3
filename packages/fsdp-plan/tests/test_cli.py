"""``fsdp-plan``: the table and the JSON are ``plan()``'s figures."""

from __future__ import annotations

import json

import pytest
import torch

from fsdp_mesh.testing.models import GPT, Block
from fsdp_plan import plan
from fsdp_plan.cli import main


def test_cli_prints_and_writes_the_plans(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(
        [
            "fsdp_mesh.testing.models:GPT",
            "--world-size",
            "4",
            "--strategy",
            "3,optim",
            "--units",
            "Block",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "optim_grads_params" in table and "optim" in table and "reduce_scatter" in table
    written = json.loads(out.read_text())
    assert [p["strategy"] for p in written] == ["optim_grads_params", "optim"]
    for entry, strategy in zip(written, (3, 1), strict=True):
        with torch.device("meta"):
            module = GPT()
        expected = plan(module, 4, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
        assert entry["per_rank"] == expected.per_rank
        assert entry["comm"] == json.loads(json.dumps(expected.comm))


def test_cli_refuses_a_bad_model_spec():
    with pytest.raises(SystemExit, match=r"module\.path:factory"):
        main(["fsdp_mesh.testing.models.GPT", "--world-size", "2"])
    with pytest.raises(SystemExit, match="Nope"):
        main(["fsdp_mesh.testing.models:GPT", "--world-size", "2", "--units", "Nope"])
