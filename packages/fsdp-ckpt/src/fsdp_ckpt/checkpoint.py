"""``save_checkpoint`` and ``load_checkpoint``: atomic, verified DCP checkpoints of a
model, its optimizer and extra state (see ``atomic``, ``manifest`` and ``extra``).

Layout of a checkpoint directory::

    .metadata, __<rank>_0.distcp   DCP: "model.<name>", "optim.state.<name>.<key>",
                                   "optim.param_groups.<i>.<hyperparameter>"
    extra/rank_<r>.pt              user data and RNG states of rank r
    fsdp_manifest.json             written last: files, sizes and CRC-32s, world size,
                                   version

This is the layout of ``dcp.save({"model": msd, "optim": osd})`` with torch's
``get_state_dict``, so an FSDP2 user loads it with plain ``dcp.load`` and
``set_state_dict``; ``load_checkpoint`` in turn also loads such plain DCP checkpoints
(see ``foreign`` and ``layout``).

All ranks call both functions (they are collectives) with the same directory, on a file
system every rank sees; the ranks compare the paths they were given (resolved: a
relative path under different working directories, a per-rank timestamp) before
anything is read or written. They also work in one process without a process group.
Every failure is a ``CheckpointError`` raised on every rank (DCP's own
``CheckpointException``, a ``BaseException``, becomes its ``__cause__``).
"""

from __future__ import annotations

import functools
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from fsdp_ckpt import _dist
from fsdp_ckpt.async_save import AsyncSaver, SaveHandle, process_saver
from fsdp_ckpt.atomic import check_replaceable, incomplete_dir, publish, resolve_for_load
from fsdp_ckpt.checksums import crc32_of_files
from fsdp_ckpt.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    ForeignCheckpointWarning,
    dcp_failure,
)
from fsdp_ckpt.extra import (
    extra_bytes,
    read_extra,
    refuse_dtensors,
    restore_rng_state,
    write_extra,
)
from fsdp_ckpt.foreign import is_foreign_dcp, verify_extents
from fsdp_ckpt.layout import OURS, Layout, detect_layout
from fsdp_ckpt.load_plan import OptimizerPlan, nest, plan_model, plan_optimizer
from fsdp_ckpt.manifest import MANIFEST_NAME, Manifest
from fsdp_ckpt.model_state import get_model_state_dict, set_model_state_dict
from fsdp_ckpt.optim_state import (
    as_optimizer_list,
    check_param_groups,
    optimizers_state_dict,
    set_optimizer_state_dict,
)
from fsdp_ckpt.validate import Mismatch

__all__ = ["MODEL_KEY", "OPTIM_KEY", "SaveHandle", "load_checkpoint", "save_checkpoint"]

MODEL_KEY = "model"  # = OURS.model_prefix without its dot
OPTIM_KEY = "optim"


def _raise_agreed(error: BaseException | None) -> None:
    agreed = _dist.agree(error)
    if agreed is not None:
        raise agreed


def _canonical(path: Path) -> Path:
    """``path`` with its parent's symlinks resolved: the same for every spelling of one
    directory (the last component is kept: a symlink there is refused by a save)."""
    return Path(os.path.realpath(path.parent)) / path.name


def _agree_first(
    path: Path,
    action: str,
    local: BaseException | None = None,
    saver: AsyncSaver | None = None,
    asynchronous: bool = False,
    wait_for_previous: bool = True,
) -> None:
    """Before anything is read or written: every rank's path must name the same
    directory (compared, resolved), and every rank's local check (``local``) must have
    passed; for a save (``saver`` given), every rank must ask for the same mode, and
    with ``wait_for_previous=False`` on any rank no rank may still be writing an
    asynchronous save. Otherwise raise ``CheckpointError`` (or the check's error) on
    every rank. One ``all_gather_object``."""
    busy = saver is not None and saver.busy()
    mine = (str(_canonical(path)), local, asynchronous, wait_for_previous, busy)
    everyone = _dist.all_gather_object(mine)
    if len({e[2] for e in everyone}) > 1:
        shown = "; ".join(f"rank {r}: asynchronous={e[2]}" for r, e in enumerate(everyone))
        raise CheckpointError(
            f"cannot {action} a checkpoint: the ranks asked for different modes ({shown}); "
            "pass the same asynchronous= on every rank"
        )
    busy_ranks = [r for r, e in enumerate(everyone) if e[4]]
    if busy_ranks and not all(e[3] for e in everyone):
        handle = saver.in_flight if saver is not None else None
        raise CheckpointError(
            f"an asynchronous save{f' to {handle.path}' if handle else ''} is still being "
            f"written on rank(s) {busy_ranks} and wait_for_previous=False; call its handle's "
            "wait() first, or save with wait_for_previous=True (the default)"
        )
    paths = [e[0] for e in everyone]
    if len(set(paths)) > 1:
        shown = "; ".join(f"rank {r}: {p}" for r, p in enumerate(paths))
        raise CheckpointError(
            f"cannot {action} a checkpoint: the ranks were given paths that differ across "
            f"ranks ({shown}); every rank must pass the same directory (compute it once, "
            "e.g. on rank 0, and broadcast it; use an absolute path when the ranks' "
            "working directories differ)"
        )
    error = _dist.first_error([e[1] for e in everyone])
    if error is not None:
        raise error


@overload
def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = ...,
    extra: dict[str, Any] | None = ...,
    *,
    asynchronous: Literal[False] = ...,
    wait_for_previous: bool = ...,
) -> Path: ...


@overload
def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = ...,
    extra: dict[str, Any] | None = ...,
    *,
    asynchronous: Literal[True],
    wait_for_previous: bool = ...,
) -> SaveHandle: ...


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
    extra: dict[str, Any] | None = None,
    *,
    asynchronous: bool = False,
    wait_for_previous: bool = True,
) -> Path | SaveHandle:
    """Save ``model`` (and ``optimizer``, and ``extra`` with every rank's RNG states)
    to the directory ``path``, atomically: an existing checkpoint there is replaced
    only once the new one is complete. Returns the path.

    ``optimizer`` may be a list of optimizers over disjoint parameters (``[muon,
    adamw]`` as ``fsdp.fully_shard`` returns them): the model is written once, their
    states under ``optim`` (see ``optim_state``); load with the same list.

    ``path`` must be the same directory on every rank, and must not exist, or be an
    empty directory, or an fsdp checkpoint holding only its own files; anything else
    is refused with ``CheckpointError`` on every rank before anything is written (a
    save never deletes other files). So are DTensors in ``extra`` (see ``extra``).

    ``asynchronous=True`` returns a ``SaveHandle`` as soon as this rank's state is
    copied into host memory (buffers kept for the next save; pinned on CUDA); the
    files are written, checksummed and published in a background thread, and
    ``handle.wait()`` blocks until they are (see Note [asynchronous save] in
    ``async_save``). One save is in flight per process: any save or load first waits
    for it and raises its failure, on every rank; with ``wait_for_previous=False`` a
    save raises ``CheckpointError`` on every rank instead of waiting while one is still
    being written on any rank."""
    started = time.perf_counter()
    saver = process_saver()
    # normpath: "." and ".." name the directory itself, whose parent holds the staging
    path = Path(os.path.normpath(Path(path).absolute()))
    local: BaseException | None = None
    try:  # local and deterministic checks, agreed with the path below
        optimizers = as_optimizer_list(optimizer, "save_checkpoint")
        for name, flag in (
            ("asynchronous", asynchronous),
            ("wait_for_previous", wait_for_previous),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"save_checkpoint: {name} must be True or False; got {flag!r}")
    except (TypeError, ValueError) as exc:
        local, optimizers = exc, []
    if local is None:
        local = refuse_dtensors(extra)
    asynchronous = asynchronous is True
    _agree_first(path, "save", local, saver, asynchronous, wait_for_previous is not False)
    # The save in flight is finished (the same on every rank: its verdict was agreed).
    saver.drain()
    group = saver.group() if asynchronous else None  # collective: every rank, here
    staging = _prepare_staging(path)
    rank = _dist.rank()

    state: dict[str, Any] = {MODEL_KEY: get_model_state_dict(model)}
    if optimizers:
        state[OPTIM_KEY] = optimizers_state_dict(model, optimizers)
    extra_data: bytes | BaseException
    try:  # pickled now: the values of the call
        extra_data = extra_bytes(extra)
    except Exception as exc:  # reported together with the other ranks' verdicts
        extra_data = CheckpointError(f"cannot pickle the extra state: {exc!r}")
    if not asynchronous:
        with _dist.quiet_single_process():
            return _write_and_publish(path, staging, state, extra_data, bool(optimizers), rank)
    try:
        staged, error = saver.stager.stage(state), None
    except (RuntimeError, OSError) as exc:  # out of host (or pinned) memory
        staged, error = (
            None,
            CheckpointError(
                f"cannot copy this rank's state into host memory for an asynchronous save "
                f"({saver.stager.nbytes} bytes staged before): {exc!r}"
            ),
        )
    _raise_agreed(error)  # a rank that could not stage must not leave the others writing
    write = functools.partial(
        _write_and_publish, path, staging, staged, extra_data, bool(optimizers), rank, group
    )
    return saver.submit(path, write, started)


def _prepare_staging(path: Path) -> Path:
    """Rank 0 checks that ``path`` may be replaced and makes an empty
    ``.<name>.incomplete``; its verdict raised on every rank."""
    staging = incomplete_dir(path)
    error: BaseException | None = None
    if _dist.rank() == 0:
        try:
            check_replaceable(path)  # never delete what is not a checkpoint
            path.parent.mkdir(parents=True, exist_ok=True)
            if staging.exists():
                shutil.rmtree(staging)  # left by an interrupted save
            staging.mkdir()
        except CheckpointError as exc:
            error = exc
        except OSError as exc:
            error = CheckpointError(f"cannot prepare {staging} for saving: {exc}")
    error = _dist.broadcast_object(error)  # also: nobody writes before it is ready
    if error is not None:
        raise error
    return staging


def _write_and_publish(
    path: Path,
    staging: Path,
    state: dict[str, Any],
    extra_data: bytes | BaseException,
    has_optimizer: bool,
    rank: int,
    group: dist.ProcessGroup | None = None,
) -> Path:
    """Write ``state`` and the extra file into ``staging``, checksum, and (rank 0)
    write the manifest and publish at ``path``; every failure raised on every rank.
    Runs in the caller (a synchronous save) or in the background thread, its
    collectives then on the saver's own ``group`` (Note [asynchronous save])."""
    error: BaseException | None = extra_data if isinstance(extra_data, BaseException) else None
    if error is None:
        try:
            write_extra(staging, rank, extra_data)  # type: ignore[arg-type]
        except Exception as exc:  # reported together with the other ranks' verdicts below
            error = CheckpointError(f"cannot write the extra state to {staging}: {exc!r}")
    try:
        dcp.save(
            state,
            storage_writer=FileSystemWriter(staging),
            # A replicated entry (a buffer, e.g. BatchNorm statistics, which ranks may
            # hold differently) is written by the lowest rank, as full state dicts and
            # consolidation take rank 0's: not spread over ranks to balance the writes.
            planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
            process_group=group,
            no_dist=not _dist.is_distributed(),
        )
    except CheckpointException as exc:  # raised by DCP on every rank
        if rank == 0:  # every rank is past its writes; the previous checkpoint stays
            shutil.rmtree(staging, ignore_errors=True)
        raise dcp_failure(exc, f"cannot save {path}") from exc
    error = _dist.agree(error, group)  # every rank has finished writing
    if error is not None:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise error
    checksums = _checksum_staging(staging, rank, group)

    if rank == 0:
        try:
            manifest = Manifest.of_directory(
                staging,
                world_size=_dist.world_size(),
                has_optimizer=has_optimizer,
                checksums=checksums,
            )
            manifest.write(staging)
            publish(staging, path)
        except CheckpointError as exc:
            error = exc
        except OSError as exc:
            error = CheckpointError(f"cannot put the checkpoint in place at {path}: {exc}")
    error = _dist.broadcast_object(error, group=group)
    if error is not None:
        raise error
    return path


def _checksum_staging(staging: Path, rank: int, group: dist.ProcessGroup | None) -> dict[str, int]:
    """Every file's CRC-32, each rank reading the files it wrote (see ``checksums``);
    the whole map on rank 0, ``{}`` elsewhere. An error raises on every rank."""
    listed = Manifest.list_files(staging) if rank == 0 else None
    files = _dist.broadcast_object(listed, group=group)
    mine: dict[str, int] = {}
    error: BaseException | None = None
    try:
        mine = crc32_of_files(staging, files, rank, _dist.world_size())
    except OSError as exc:
        error = CheckpointError(f"cannot read back {staging} to checksum it: {exc}")
    everyone = _dist.all_gather_object((mine, error), group)
    for _crcs, err in everyone:
        if err is not None:
            raise err
    return {rel: crc for crcs, _err in everyone for rel, crc in crcs.items()} if rank == 0 else {}


def _verify_checksums(directory: Path, manifest: Manifest) -> None:
    """Every rank checksums its share of the files (see ``checksums``); any mismatch
    raises ``CorruptCheckpointError`` on every rank, naming every damaged file."""
    rank, world = _dist.rank(), _dist.world_size()
    try:
        computed = crc32_of_files(directory, manifest.checksums, rank, world)
        problems = manifest.checksum_problems(directory, computed)
    except OSError as exc:
        problems = [f"cannot read a file to verify it: {exc}"]
    found = sorted({p for mine in _dist.all_gather_object(problems) for p in mine})
    if found:
        raise CorruptCheckpointError(
            f"checkpoint {directory} is damaged; refusing to load it: " + "; ".join(found)
        )


def _inspect(directory: Path) -> Manifest | None:
    """Rank 0 reads the manifest and checks every listed file; all ranks get its
    verdict (one stat per file in all, not per rank). None: a plain DCP checkpoint
    (see ``foreign``), checked as far as it can be, with one warning."""
    verdict: Manifest | BaseException | None = None
    if _dist.rank() == 0:
        try:
            if is_foreign_dcp(directory):
                verify_extents(directory)
                warnings.warn(
                    f"{directory} is a plain torch.distributed.checkpoint checkpoint, not "
                    f"one of fsdp_ckpt.save_checkpoint: it has no {MANIFEST_NAME}, so its "
                    f"file sizes cannot be verified (only that no file ends before the data "
                    f"DCP's .metadata places in it), and it holds no extra state or RNG "
                    f"states; loading it through DCP",
                    ForeignCheckpointWarning,
                    stacklevel=3,
                )
            else:
                verdict = Manifest.read(directory)
                verdict.verify(directory)
        except CheckpointError as exc:
            verdict = exc
    verdict = _dist.broadcast_object(verdict)
    if isinstance(verdict, BaseException):
        raise verdict
    if verdict is not None and verdict.checksums:
        _verify_checksums(directory, verdict)
    return verdict


def _layout(
    directory: Path,
    manifest: Manifest | None,
    metadata: Metadata,
    model_keys: list[str],
    *,
    want_optimizer: bool,
) -> Layout:
    if manifest is None:
        return detect_layout(metadata, model_keys, directory, want_optimizer=want_optimizer)
    if want_optimizer and not manifest.has_optimizer:
        raise CheckpointMismatchError(
            f"{directory} holds no optimizer state; load it without an optimizer"
        )
    return OURS


def _raise_mismatches(directory: Path, model: Mismatch, plan: OptimizerPlan | None) -> None:
    """Raise, on every rank alike, what any rank found wrong before loading. Ranks may
    hold different keys (expert parallelism): see ``Mismatch.combine``."""
    mine = (model, None if plan is None else plan.state_mismatch, plan.problems if plan else [])
    everyone = _dist.all_gather_object(mine)
    found = [Mismatch.combine([m for m, _s, _p in everyone]).describe()]
    if plan is not None:
        found.append(Mismatch.combine([s for _m, s, _p in everyone]).describe())
    found += list(dict.fromkeys(p for _m, _s, problems in everyone for p in problems))
    found = [f for f in found if f]
    if found:
        raise CheckpointMismatchError(
            f"checkpoint {directory} does not match what is being loaded: " + "; ".join(found)
        )


def _dcp_load(state: dict[str, Any], directory: Path) -> None:
    try:
        with _dist.quiet_single_process():
            dcp.load(
                state,
                storage_reader=FileSystemReader(directory),
                no_dist=not _dist.is_distributed(),
            )
    except CheckpointException as exc:  # raised by DCP on every rank
        raise dcp_failure(exc, f"cannot load {directory}") from exc


def _check_saved_param_groups(directory: Path, model: nn.Module, plan: OptimizerPlan) -> None:
    """Read only the saved param groups (names and hyperparameters: small) and check
    them against the optimizers', on every rank alike, before anything is loaded."""
    groups_only: dict[str, Any] = {}
    node = nest(
        groups_only, plan.prefix, {"state": {}, "param_groups": plan.to_load["param_groups"]}
    )
    _dcp_load(groups_only, directory)
    error: BaseException | None = None
    try:  # they may differ on some ranks only (keys that differ across ranks)
        for optimizer, part in plan.parts(node):
            check_param_groups(model, optimizer, part)
    except CheckpointMismatchError as exc:
        error = exc
    _raise_agreed(error)


def _resolve_agreed(path: Path) -> Path:
    """``resolve_for_load`` on every rank (the ranks may see a save's renames at
    different moments), any rank's failure raised on every rank."""
    try:
        directory, error = resolve_for_load(path), None
    except CheckpointError as exc:
        directory, error = path, exc
    _raise_agreed(error)
    return directory


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
    *,
    strict: bool = True,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by ``save_checkpoint`` (at any world size, strategy or
    wrapper) into ``model`` and ``optimizer`` (or the list of optimizers it was saved
    with), in place; restore this rank's RNG states; return the ``extra`` dict that was
    saved.

    Also loads a plain DCP checkpoint (``dcp.save`` of torch's ``get_state_dict``
    output, e.g. from FSDP2), its layout read from its keys (see ``layout``), with a
    ``ForeignCheckpointWarning``; it returns ``{}`` and restores no RNG state.

    Refuses, on every rank, paths that name different directories on different ranks, a
    directory without a manifest that is not a complete DCP checkpoint (an interrupted
    save), a file whose size or CRC-32 differs from the manifest (truncated or
    overwritten: ``CorruptCheckpointError`` naming it; one read of every byte, spread
    over the ranks, see ``checksums``), and keys or shapes that do not match (naming
    them; ``strict=False`` ignores model entries of the checkpoint that the model does
    not have)."""
    process_saver().drain()  # a save in flight (maybe to this path) is published first
    given = Path(os.path.normpath(Path(path).absolute()))
    local: BaseException | None = None
    try:
        optimizers = as_optimizer_list(optimizer, "load_checkpoint")
    except (TypeError, ValueError) as exc:
        local, optimizers = exc, []
    _agree_first(given, "load", local)
    directory = _resolve_agreed(given)
    manifest = _inspect(directory)

    try:
        metadata = FileSystemReader(directory).read_metadata()
    except Exception as exc:  # a damaged pickle raises anything
        raise CorruptCheckpointError(f"cannot read {directory}/.metadata: {exc!r}") from exc
    model_sd = get_model_state_dict(model)
    layout = _layout(directory, manifest, metadata, list(model_sd), want_optimizer=bool(optimizers))
    state: dict[str, Any] = {}
    model_node = nest(state, layout.model_prefix, model_sd)
    model_mismatch = plan_model(model_sd, metadata, layout, strict=strict)
    plan = plan_optimizer(model, optimizers, metadata, layout) if optimizers else None
    if plan is not None:
        optim_node = nest(state, plan.prefix, plan.to_load)
    _raise_mismatches(directory, model_mismatch, plan)
    if plan is not None:
        _check_saved_param_groups(directory, model, plan)

    _dcp_load(state, directory)
    set_model_state_dict(model, {k: model_node[k] for k in model_sd}, strict=strict)
    if plan is not None:  # their groups were checked above
        for opt, part in plan.parts(optim_node):
            set_optimizer_state_dict(model, opt, part)
    if manifest is None:
        return {}
    saved = read_extra(directory, _dist.rank(), manifest.world_size == _dist.world_size())
    if restore_rng:
        restore_rng_state(saved["rng"])
    return saved["user"]
