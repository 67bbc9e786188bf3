"""What megatron_fsdp 0.6.1's ``utils`` gives its users, as fsdp_mesh gives it:

- ``FSDPDistributedIndex``'s positional order (..., ``hybrid_fsdp_group``,
  ``hybrid_fsdp_expt_group``, ``hsdp_outer_dp_shard``, ``expt_device_mesh``,
  ``fsdp_group_ag``, ``expt_fsdp_group_ag``); the independent all-gather groups are kept
  and returned by ``get_fsdp_group(independent_all_gather=True)`` (None when not given);
  without an expert mesh ``expt_device_mesh`` is None.
- ``safe_get_rank`` (torch.distributed's rank, else ``RANK``, else 0),
  ``log_single_rank`` (logs on one rank only), ``using_tensor_parallel`` (a tp dim of
  more than one rank).
"""

from __future__ import annotations

import logging

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fsdp_mesh import (
    FSDPDistributedIndex,
    build_device_mesh,
    log_single_rank,
    safe_get_rank,
    using_tensor_parallel,
)
from fsdp_mesh.testing import run_distributed


def test_safe_get_rank_without_torch_distributed(monkeypatch):
    assert not dist.is_initialized()
    monkeypatch.setenv("RANK", "3")
    assert safe_get_rank() == 3
    monkeypatch.setenv("RANK", "not a number")
    assert safe_get_rank() == 0
    monkeypatch.delenv("RANK")
    assert safe_get_rank() == 0


def test_log_single_rank(monkeypatch, caplog):
    logger = logging.getLogger("fsdp_mesh.test_megatron_utils")
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.INFO, logger=logger.name):
        log_single_rank(logger, logging.INFO, "on rank %d", 0)
        log_single_rank(logger, logging.INFO, "on rank %d", 1, rank=1)
    assert [r.getMessage() for r in caplog.records] == ["on rank 1"]


class _IndexLike:
    """What megatron_fsdp's ``using_tensor_parallel`` reads of an index: ``tp_dim`` and
    ``get_submesh`` (no ``get_root_mesh``)."""

    def __init__(self, mesh, tp_dim):
        self.mesh, self.tp_dim = mesh, tp_dim

    def get_submesh(self, dim, is_expert_parallel=False):
        return self.mesh[dim]


def _index_checks() -> dict:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g02, g13 = dist.new_group([0, 2]), dist.new_group([1, 3])  # every rank, same order
    ag, ag_other = (g02, g13) if rank in (0, 2) else (g13, g02)
    # Positional, in megatron_fsdp's order.
    index = FSDPDistributedIndex(mesh, "dp", None, "tp", None, None, False, None, ag, None)
    out = {
        "ag": index.get_fsdp_group(independent_all_gather=True) is ag,
        "ag_attr": index.fsdp_group_ag is ag and index.expt_fsdp_group_ag is None,
        "expt_ag": index.get_fsdp_group(is_expert_parallel=True, independent_all_gather=True),
        "shard": dist.get_process_group_ranks(index.get_fsdp_group()),
        "expt_mesh": index.expt_device_mesh,
        "tp": using_tensor_parallel(index),
        "tp_expert": using_tensor_parallel(index, is_expert_parallel=True),
    }
    plain = FSDPDistributedIndex(init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
    out["tp_plain"] = using_tensor_parallel(plain)
    out["tp_index_like"] = using_tensor_parallel(_IndexLike(mesh, "tp"))
    out["none_index_like"] = using_tensor_parallel(_IndexLike(mesh, None))
    meshes = build_device_mesh(dp_shard=4, tp=1, expert_parallel=2, device_type="cpu")
    eindex = FSDPDistributedIndex(**meshes.fsdp_kwargs())
    out["has_expert_mesh"] = eindex.expt_device_mesh is meshes.expt_device_mesh
    try:
        FSDPDistributedIndex(mesh, "dp", tp_dim="tp", fsdp_group_ag=ag_other)
    except ValueError as err:
        out["bad_ag"] = str(err)
    return out


def test_distributed_index_matches_megatron_fsdp():
    for rank, out in enumerate(run_distributed(_index_checks, 4)):
        assert out["ag"] and out["ag_attr"] and out["expt_ag"] is None
        assert out["shard"] == ([0, 2] if rank in (0, 2) else [1, 3])
        assert out["expt_mesh"] is None  # dense: no expert mesh, as in Megatron-FSDP
        assert out["tp"] and out["tp_expert"] and not out["tp_plain"]
        # An index-like object megatron_fsdp accepts (no get_root_mesh).
        assert out["tp_index_like"] is True
        assert out["none_index_like"] is False
        assert out["has_expert_mesh"]
        assert "must hold the same ranks" in out["bad_ag"]


def _single() -> bool:
    index = FSDPDistributedIndex(init_device_mesh("cpu", (1,)))
    assert index.expt_device_mesh is None and not index.has_expert_mesh
    assert index.get_root_mesh(is_expert_parallel=True) is index.device_mesh
    return True


def test_single_rank_index_has_no_expert_mesh():
    assert run_distributed(_single, 1) == [True]
