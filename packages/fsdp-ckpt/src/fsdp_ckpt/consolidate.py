"""One-file, unsharded model state dicts: gathered from a running model, or read from
a checkpoint directory without launching ranks. The file (``torch.save`` or
safetensors) loads into the plain ``nn.Module`` with ``load_state_dict``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from fsdp_buffers.collectives import all_gather_uneven
from fsdp_ckpt import _dist
from fsdp_ckpt.atomic import resolve_for_load
from fsdp_ckpt.errors import CheckpointError, CorruptCheckpointError, dcp_failure
from fsdp_ckpt.manifest import Manifest
from fsdp_ckpt.names import entry_of, param_by_state_key
from fsdp_ckpt.row_shards import RowLayout, resolve_row_layouts

__all__ = [
    "Format",
    "consolidate_checkpoint",
    "get_full_model_state_dict",
    "load_full_state_dict",
    "save_full_model_state_dict",
    "write_state_dict_file",
]

Format = Literal["torch", "safetensors"]


def _gather_rows(dt: DTensor, layout: RowLayout) -> torch.Tensor:
    """The whole tensor from its row shards (and tensor-parallel pieces): padded
    all-gathers along the shard (and tp) dimensions of its mesh (DTensor's own
    ``full_tensor`` assumes chunk sizes). Other mesh dimensions are Replicate."""
    mesh = dt.device_mesh
    full = all_gather_uneven(dt.to_local(), 0, layout.partition, mesh.get_group(layout.mesh_dim))
    tp = layout.tp
    if tp is not None:
        full = all_gather_uneven(full, tp.tensor_dim, tp.ranges, mesh.get_group(tp.mesh_dim))
    return full


def get_full_model_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, Any]:
    """The unsharded state dict of ``model`` on CPU, under its state dict names. A
    collective: every rank calls it; with ``rank0_only`` the other ranks get ``{}``.
    Tied parameters are gathered once. Entries only some ranks hold (experts under
    expert parallelism) are sent by the first rank holding each to those lacking it."""
    sd = model.state_dict()
    params = param_by_state_key(model, sd.keys())
    layouts = resolve_row_layouts({k: entry_of(v, params.get(k)) for k, v in sd.items()})
    me = _dist.rank()
    keep = not rank0_only or me == 0
    sent = _entries_to_send(list(sd), rank0_only)
    out: dict[str, Any] = {}
    done: dict[int, torch.Tensor] = {}
    for key, value in sd.items():
        param = params.get(key)
        if param is not None and id(param) in done:
            full = done[id(param)]
        else:
            if isinstance(value, DTensor):
                layout = layouts.get(key)
                full = _gather_rows(value, layout) if layout is not None else value.full_tensor()
            else:
                full = value
            if isinstance(full, torch.Tensor):
                live = value.to_local() if isinstance(value, DTensor) else value
                full = full.detach().cpu()
                if full.untyped_storage().data_ptr() == live.untyped_storage().data_ptr():
                    full = full.clone()  # a snapshot, not a view of the live model
            if param is not None:
                done[id(param)] = full
        if keep or key in (sent or ()):
            out[key] = full
    if sent is not None:
        payload = {k: out[k] if keep else out.pop(k) for k in sent}
        for entries in _exchange(payload, rank0_only):
            for key, value in entries.items():
                out.setdefault(key, value)
    return out if keep else {}


def _entries_to_send(keys: list[str], rank0_only: bool) -> set[str] | None:
    """The keys this rank must send, as the first rank holding them, to ranks that
    lack them (rank 0 alone with ``rank0_only``); None when every rank holds the same
    keys. A collective."""
    held = [set(k) for k in _dist.all_gather_object(keys)]
    if all(k == held[0] for k in held):
        return None
    first: dict[str, int] = {}
    for rank, mine in enumerate(held):
        for key in mine:
            first.setdefault(key, rank)
    wanting = held[:1] if rank0_only else held
    lacking = set(first) - set.intersection(*wanting)
    return {k for k in lacking if first[k] == _dist.rank()}


def _exchange(payload: dict[str, Any], rank0_only: bool) -> list[dict[str, Any]]:
    """Every rank's ``payload``: on rank 0 alone (others get []) with ``rank0_only``."""
    if not rank0_only:
        return _dist.all_gather_object(payload)
    received: list[Any] = [None] * _dist.world_size() if _dist.rank() == 0 else []
    dist.gather_object(payload, received if _dist.rank() == 0 else None, dst=0)
    return received


def _infer_format(path: Path, format: Format | None) -> Format:
    if format is not None:
        if format not in ("torch", "safetensors"):
            raise ValueError(f"format must be 'torch' or 'safetensors'; got {format!r}")
        return format
    return "safetensors" if path.suffix == ".safetensors" else "torch"


def write_state_dict_file(
    state_dict: dict[str, Any], path: str | os.PathLike[str], format: Format | None = None
) -> Path:
    """Write a full state dict to one file: safetensors when ``format`` says so or the
    name ends in ``.safetensors``, else ``torch.save``. Written to a temporary name and
    renamed, so the file is either complete or absent (the temporary name removed on
    failure)."""
    path = Path(path)
    fmt = _infer_format(path, format)
    _check_output(path)
    tmp = path.with_name(f".{path.name}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        _write(state_dict, tmp, fmt)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _check_output(path: Path) -> None:
    if path.is_dir():
        raise CheckpointError(
            f"the output {path} is a directory; give the name of the file to write (a "
            "directory only with --hf)"
        )


def _write(state_dict: dict[str, Any], tmp: Path, fmt: Format) -> None:
    if fmt == "safetensors":
        from safetensors.torch import save_file

        bad = sorted(k for k, v in state_dict.items() if not isinstance(v, torch.Tensor))
        if bad:
            raise CheckpointError(
                f"safetensors holds only tensors; these entries are not: {bad}; use format='torch'"
            )
        # Tied weights share storage, which safetensors refuses: give each its own.
        seen: set[tuple[int, int]] = set()
        tensors = {}
        for k, v in state_dict.items():
            ident = (v.untyped_storage().data_ptr(), v.storage_offset())
            tensors[k] = v.clone().contiguous() if ident in seen and v.numel() else v.contiguous()
            seen.add(ident)
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    else:
        torch.save(state_dict, tmp)


def load_full_state_dict(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a file written by ``write_state_dict_file``: safetensors when the name ends
    in ``.safetensors``, else ``torch.load`` (tensors only, ``weights_only=True``)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def save_full_model_state_dict(
    model: nn.Module, path: str | os.PathLike[str], format: Format | None = None
) -> Path:
    """Gather ``model``'s full state dict and write it to one file on rank 0. A
    collective; returns the path on every rank."""
    sd = get_full_model_state_dict(model, rank0_only=True)
    error: BaseException | None = None
    if _dist.rank() == 0:
        try:
            write_state_dict_file(sd, path, format)
        except Exception as exc:
            error = CheckpointError(f"cannot write the full state dict to {path}: {exc!r}")
    error = _dist.broadcast_object(error)
    if error is not None:
        raise error
    return Path(path)


def _unflatten(sd: dict[str, Any], prefix: str, planner_data: object) -> dict[str, Any]:
    """The model state dict under its own keys, with the dict values DCP flattened
    into leaves (a module's dict extra state, ``_extra_state.calls``) nested again, from
    the paths DCP's save planner recorded."""
    paths = planner_data if isinstance(planner_data, dict) else {}
    root = prefix.removesuffix(".")
    full: dict[str, Any] = {}
    for key, value in sd.items():
        path = paths.get(key)
        if isinstance(path, tuple) and len(path) > 2 and path[0] == root:
            node = full.setdefault(path[1], {})
            for part in path[2:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = value
        else:
            full[key[len(prefix) :]] = value
    return full


def consolidate_checkpoint(
    checkpoint: str | os.PathLike[str],
    output: str | os.PathLike[str],
    format: Format | None = None,
    *,
    prefix: str = "model.",
) -> dict[str, int]:
    """Turn a checkpoint directory of ``save_checkpoint`` into one full model state
    dict file, in this process alone (no process group, no ranks). Verifies the
    manifest first (sizes and checksums). Returns ``{"tensors": n, "bytes": b}``."""
    _check_output(Path(output))  # before the checkpoint is read
    full = read_full_model_state(checkpoint, prefix=prefix)
    write_state_dict_file(full, output, format)
    tensors = [v for v in full.values() if isinstance(v, torch.Tensor)]
    return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors)}


def read_full_model_state(
    checkpoint: str | os.PathLike[str], *, prefix: str = "model."
) -> dict[str, Any]:
    """The full model state dict of a ``save_checkpoint`` directory, read in this
    process alone (the manifest verified first)."""
    directory = resolve_for_load(Path(checkpoint).absolute())
    Manifest.read(directory).verify(directory, checksums=True)
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except Exception as exc:  # a damaged pickle raises anything (version 1: no checksum)
        raise CorruptCheckpointError(f"cannot read {directory}/.metadata: {exc!r}") from exc
    sd: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(prefix):
            sd[key] = (
                torch.empty(md.size, dtype=md.properties.dtype)
                if isinstance(md, TensorStorageMetadata)
                else None
            )
    if not sd:
        raise CheckpointError(f"{directory} has no entries under {prefix!r}")
    try:
        with _dist.quiet_single_process():
            dcp.load(sd, storage_reader=FileSystemReader(directory), no_dist=True)
    except CheckpointException as exc:  # a BaseException: see errors
        raise dcp_failure(exc, f"cannot read {directory}") from exc
    return _unflatten(sd, prefix, metadata.planner_data)
