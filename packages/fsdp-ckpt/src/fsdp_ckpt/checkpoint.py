"""``save_checkpoint`` and ``load_checkpoint``: atomic, verified DCP checkpoints of a
model, its optimizer and extra state (see ``atomic``, ``manifest`` and ``extra``).

Layout of a checkpoint directory::

    .metadata, __<rank>_0.distcp   DCP: "model.<name>", "optim.state.<name>.<key>",
                                   "optim.param_groups.<i>.<hyperparameter>"
    extra/rank_<r>.pt              user data and RNG states of rank r
    fsdp_manifest.json             written last: files and sizes, world size, version

All ranks call both functions (they are collectives); the directory must be on a file
system every rank sees. They also work in one process without a process group.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fsdp_ckpt import _dist
from fsdp_ckpt.atomic import incomplete_dir, publish, resolve_for_load
from fsdp_ckpt.errors import CheckpointError, CheckpointMismatchError
from fsdp_ckpt.extra import read_extra, restore_rng_state, write_extra
from fsdp_ckpt.manifest import Manifest
from fsdp_ckpt.model_state import get_model_state_dict, set_model_state_dict
from fsdp_ckpt.optim_state import (
    get_optimizer_state_dict,
    init_optimizer_state,
    optimizer_param_fqns,
    set_optimizer_state_dict,
)
from fsdp_ckpt.validate import flatten, mismatches

__all__ = ["MODEL_KEY", "OPTIM_KEY", "load_checkpoint", "save_checkpoint"]

MODEL_KEY = "model"
OPTIM_KEY = "optim"
_GROUPS_PREFIX = f"{OPTIM_KEY}.param_groups."
_STATE_PREFIX = f"{OPTIM_KEY}.state."


def _raise_agreed(error: BaseException | None) -> None:
    agreed = _dist.agree(error)
    if agreed is not None:
        raise agreed


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save ``model`` (and ``optimizer``, and ``extra`` with every rank's RNG states)
    to the directory ``path``, atomically: an existing checkpoint there is replaced
    only once the new one is complete. Returns the path."""
    path = Path(path).absolute()
    staging = incomplete_dir(path)
    rank = _dist.rank()
    error: BaseException | None = None
    if rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if staging.exists():
                shutil.rmtree(staging)  # left by an interrupted save
            staging.mkdir()
        except OSError as exc:
            error = CheckpointError(f"cannot prepare {staging} for saving: {exc}")
    error = _dist.broadcast_object(error)  # also: nobody writes before it is ready
    if error is not None:
        raise error

    state: dict[str, Any] = {MODEL_KEY: get_model_state_dict(model)}
    if optimizer is not None:
        state[OPTIM_KEY] = get_optimizer_state_dict(model, optimizer)
    try:
        write_extra(staging, rank, extra)
    except Exception as exc:  # reported together with the other ranks' verdicts below
        error = CheckpointError(f"cannot write the extra state to {staging}: {exc!r}")
    with _dist.quiet_single_process():
        dcp.save(
            state, storage_writer=FileSystemWriter(staging), no_dist=not _dist.is_distributed()
        )
    _raise_agreed(error)  # every rank has finished writing

    if rank == 0:
        try:
            manifest = Manifest.of_directory(
                staging, world_size=_dist.world_size(), has_optimizer=optimizer is not None
            )
            manifest.write(staging)
            publish(staging, path)
        except OSError as exc:
            error = CheckpointError(f"cannot put the checkpoint in place at {path}: {exc}")
    error = _dist.broadcast_object(error)
    if error is not None:
        raise error
    return path


def _read_verified_manifest(directory: Path) -> Manifest:
    """Rank 0 reads the manifest and checks every listed file; all ranks get its
    verdict (one stat per file in all, not per rank)."""
    verdict: Manifest | BaseException | None = None
    if _dist.rank() == 0:
        try:
            verdict = Manifest.read(directory)
            verdict.verify(directory)
        except CheckpointError as exc:
            verdict = exc
    verdict = _dist.broadcast_object(verdict)
    if isinstance(verdict, BaseException):
        raise verdict
    assert isinstance(verdict, Manifest)
    return verdict


def _saved_state_fqns(metadata: Metadata, fqns: list[str]) -> set[str]:
    """The parameters among ``fqns`` that have optimizer state in the checkpoint
    (keys ``optim.state.<fqn>.<state name>``)."""
    wanted = set(fqns)
    found: set[str] = set()
    for key in metadata.state_dict_metadata:
        if not key.startswith(_STATE_PREFIX):
            continue
        rest = key[len(_STATE_PREFIX) :]
        dot = rest.rfind(".")
        while dot > 0:
            if rest[:dot] in wanted:
                found.add(rest[:dot])
                break
            dot = rest.rfind(".", 0, dot)
    return found


def _param_groups_skeleton(metadata: Metadata) -> list[dict[str, Any]]:
    """Placeholders for every saved param-group entry, for DCP to fill in."""
    groups: dict[int, dict[str, Any]] = {}
    for key, md in metadata.state_dict_metadata.items():
        if not key.startswith(_GROUPS_PREFIX):
            continue
        index, _, name = key[len(_GROUPS_PREFIX) :].partition(".")
        placeholder = (
            torch.empty(md.size, dtype=md.properties.dtype)
            if isinstance(md, TensorStorageMetadata)
            else None
        )
        groups.setdefault(int(index), {})[name] = placeholder
    return [groups[i] for i in sorted(groups)]


def _optimizer_state_to_load(
    model: nn.Module, optimizer: torch.optim.Optimizer, metadata: Metadata
) -> dict[str, Any]:
    """The optimizer's live state (created where the checkpoint has some and the
    optimizer has none yet) for the parameters the checkpoint has state for."""
    fqns = optimizer_param_fqns(model, optimizer)
    saved = _saved_state_fqns(metadata, fqns)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    init_optimizer_state(
        optimizer, [p for p, fqn in zip(params, fqns, strict=True) if fqn in saved]
    )
    osd = get_optimizer_state_dict(model, optimizer)
    osd["state"] = {fqn: v for fqn, v in osd["state"].items() if fqn in saved}
    osd["param_groups"] = _param_groups_skeleton(metadata)
    return osd


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by ``save_checkpoint`` (at any world size, strategy or
    wrapper) into ``model`` and ``optimizer``, in place; restore this rank's RNG
    states; return the ``extra`` dict that was saved.

    Refuses, on every rank, a directory without a manifest (an interrupted save), a
    file whose size differs from the manifest (truncated), and keys or shapes that do
    not match (naming them; ``strict=False`` ignores model entries of the checkpoint
    that the model does not have)."""
    directory = resolve_for_load(Path(path).absolute())
    manifest = _read_verified_manifest(directory)

    metadata = FileSystemReader(directory).read_metadata()
    state: dict[str, Any] = {MODEL_KEY: get_model_state_dict(model)}
    problems = [mismatches(flatten(state[MODEL_KEY], MODEL_KEY), metadata, "model.", strict=strict)]
    if optimizer is not None:
        if not manifest.has_optimizer:
            raise CheckpointMismatchError(
                f"{directory} holds no optimizer state; load it without an optimizer"
            )
        osd = _optimizer_state_to_load(model, optimizer, metadata)
        saved_groups, groups = len(osd["param_groups"]), len(optimizer.param_groups)
        if saved_groups != groups:
            problems.append(
                f"the checkpoint has {saved_groups} optimizer param group(s), this "
                f"optimizer {groups}"
            )
        state[OPTIM_KEY] = osd
        problems.append(mismatches(flatten(osd["state"], "optim.state"), metadata, _STATE_PREFIX))
    found = [p for p in problems if p]
    _raise_agreed(
        CheckpointMismatchError(
            f"checkpoint {directory} does not match what is being loaded: " + "; ".join(found)
        )
        if found
        else None
    )

    with _dist.quiet_single_process():
        dcp.load(
            state,
            storage_reader=FileSystemReader(directory),
            no_dist=not _dist.is_distributed(),
        )
    set_model_state_dict(model, state[MODEL_KEY], strict=strict)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state[OPTIM_KEY])
    saved = read_extra(directory, _dist.rank(), manifest.world_size == _dist.world_size())
    if restore_rng:
        restore_rng_state(saved["rng"])
    return saved["user"]
