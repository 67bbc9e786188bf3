"""``from_pretrained``: a Hugging Face model from a local ``save_pretrained`` directory,
built on the meta device, sharded, and loaded rank by rank.

Note on loading. No rank ever holds the whole model: the model is built under
``torch.device("meta")``, wrapped by ``fully_shard_model(..., init_model_with_meta_device=True)``
(the model's own initializer fills what the checkpoint does not hold: rotary
``inv_freq`` and other non-persistent buffers), then every target tensor is read from
the safetensors files (single file or sharded index), converted, and this rank's piece
of it copied into its shard; the full tensor is dropped before the next one. So a rank
holds its shards plus about one converted tensor (and its sources).

The checkpoint's names and shapes are mapped by transformers' own loading machinery,
``get_model_conversion_mapping`` (the model's registered ``WeightRenaming`` and
``WeightConverter`` transforms, legacy renames included) and ``rename_source_key``, then
each converter's ``convert``: per-expert tensors fused into 3-D, renamed keys, split or
concatenated projections, exactly as ``PreTrainedModel.from_pretrained`` would do them.
No table of our own. The slice a rank keeps is the DTensor's own
(``fsdp_mesh.dtensor_chunks.chunk_piece``: the ``torch.chunk`` piece of ``Shard(d)``).

Never silently wrong: a checkpoint key that maps to nothing in the model, a shape that
differs from the model's, a conversion that fails and a parameter or persistent buffer
left unloaded are errors naming them (keys the model lists in
``_keys_to_ignore_on_load_unexpected`` / ``_keys_to_ignore_on_load_missing`` excepted, as
transformers does). Every rank reads the same files and runs the same checks, so every
rank raises.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_hooks.fully_shard import fully_shard_model
from fsdp_hooks.module.megatron_fsdp import MegatronFSDP
from fsdp_hooks.module.transformers_model import import_transformers, save_pretrained
from fsdp_mesh.dtensor_chunks import chunk_piece

__all__ = ["from_pretrained", "save_pretrained"]

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_MAX_NAMES = 10  # names listed in an error message


def _names(names: list[str]) -> str:
    more = len(names) - _MAX_NAMES
    return f"{names[:_MAX_NAMES]}{f' and {more} more' if more > 0 else ''}"


def _checkpoint_files(directory: Path) -> dict[str, Path]:
    """Checkpoint key -> safetensors file, from the index or the single file."""
    from safetensors import safe_open

    index = directory / _INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {key: directory / name for key, name in weight_map.items()}
        absent = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if absent:
            raise FileNotFoundError(f"{index} names safetensors files that are absent: {absent}")
        return files
    single = directory / _SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise FileNotFoundError(
        f"no safetensors checkpoint in {directory}: expected {_SINGLE_FILE} or {_INDEX_FILE} "
        f"(a directory written by save_pretrained; .bin checkpoints are not read)"
    )


def _reader(files: dict[str, Path]) -> Callable[[str], Callable[[], torch.Tensor]]:
    """A loader per key: reads that tensor alone when called (``safe_open`` maps the
    file; nothing else is read)."""
    from safetensors import safe_open

    def loader(key: str) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            with safe_open(files[key], framework="pt") as f:
                return f.get_tensor(key)

        return load

    return loader


def _matches_any(key: str, patterns: list[str] | None) -> bool:
    return any(re.search(p, key) for p in patterns or ())


def _copy_into(name: str, dest: torch.Tensor, full: torch.Tensor) -> None:
    if tuple(full.shape) != tuple(dest.shape):
        raise ValueError(
            f"from_pretrained: checkpoint tensor for {name!r} has shape {tuple(full.shape)} "
            f"after transformers' conversion, the model's is {tuple(dest.shape)}: the "
            f"config does not describe this checkpoint"
        )
    if isinstance(dest, DTensor):
        piece = chunk_piece(full, dest)
        local = dest.to_local()
        if piece.shape != local.shape:
            raise RuntimeError(
                f"from_pretrained: {name!r}: this rank's shard has shape {tuple(local.shape)}, "
                f"its DTensor placements {dest.placements} give {tuple(piece.shape)}; the "
                f"shard does not follow the DTensor contract (torch.chunk pieces), so it "
                f"cannot be loaded without guessing"
            )
        local.copy_(piece)
    else:
        dest.copy_(full)


def load_pretrained_weights(wrapper: MegatronFSDP, directory: str | os.PathLike[str]) -> None:
    """Load a ``save_pretrained`` safetensors checkpoint into the sharded
    ``wrapper.module`` (a transformers model), each rank its own piece (see the module
    note), then refresh the compute weights."""
    import_transformers()
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    model = wrapper.module
    directory = Path(directory)
    files = _checkpoint_files(directory)
    loader = _reader(files)
    state = model.state_dict()

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None) or None

    plan: dict[str, Any] = {}
    unexpected: list[str] = []
    for key in sorted(files, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if target not in state and key in state:  # the name needed no renaming
            target, pattern = rename_source_key(key, [], [], prefix, state)
        if target not in state:
            if not _matches_any(key, getattr(model, "_keys_to_ignore_on_load_unexpected", None)):
                unexpected.append(f"{key} (mapped to {target!r})" if target != key else key)
            continue
        if pattern is not None:
            mapping = plan.setdefault(target, deepcopy(by_pattern[pattern]))
        else:
            mapping = plan.setdefault(target, WeightRenaming(key, target))
            pattern = key
        mapping.add_tensor(target, key, pattern, loader(key))
    if unexpected:
        raise ValueError(
            f"from_pretrained: checkpoint keys in {directory} that map to no parameter or "
            f"buffer of {type(model).__name__} (after transformers' conversions): "
            f"{_names(unexpected)}"
        )

    # Tied names share one tensor: loading any of them loads it.
    owner: dict[str, int] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        owner[name] = id(t)
    for name, t in model.named_buffers(remove_duplicate=False):
        owner[name] = id(t)
    loaded: set[int] = set()
    with torch.no_grad():
        for first, mapping in plan.items():
            try:
                converted = mapping.convert(first, model=model, config=model.config)
            except Exception as e:
                raise ValueError(
                    f"from_pretrained: transformers' conversion for {first!r} "
                    f"({type(mapping).__name__}) failed: {e}"
                ) from e
            for name, value in converted.items():
                tensor = value[0] if isinstance(value, list) else value
                if name not in state:
                    raise ValueError(
                        f"from_pretrained: transformers' conversion produced {name!r}, which "
                        f"{type(model).__name__} does not have"
                    )
                _copy_into(name, state[name], tensor)
                loaded.add(owner.get(name, id(state[name])))
            del converted

    ignore_missing = getattr(model, "_keys_to_ignore_on_load_missing", None)
    missing = [
        name
        for name in state
        if owner.get(name, -1) not in loaded and not _matches_any(name, ignore_missing)
    ]
    if missing:
        raise ValueError(
            f"from_pretrained: {type(model).__name__} entries that {directory} does not "
            f"hold (they would keep their random initialization): {_names(missing)}"
        )
    wrapper.install_optimized_model_weights()


def _build_on_meta(model_class: Any, directory: Path, dtype: torch.dtype) -> nn.Module:
    transformers = import_transformers()
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    with torch.device("meta"):
        if hasattr(model_class, "from_config"):  # an Auto class
            model = model_class.from_config(config, dtype=dtype)
        elif isinstance(model_class, type) and issubclass(
            model_class, transformers.PreTrainedModel
        ):
            model = model_class._from_config(config, dtype=dtype)
        else:
            raise TypeError(
                f"from_pretrained: model_class must be a transformers model class "
                f"(PreTrainedModel subclass) or Auto class; got {model_class!r}"
            )
    wrong = sorted({str(p.dtype) for p in model.parameters() if p.dtype != dtype})
    if wrong:
        model.to(dtype)  # on the meta device: no memory
    return model


def _default_units(model: nn.Module) -> list[type[nn.Module]] | None:
    """The model's ``_no_split_modules`` classes (its transformer blocks)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    units = {type(m) for m in model.modules() if type(m).__name__ in names}
    return sorted(units, key=lambda t: t.__qualname__) or None


def from_pretrained(
    model_class: Any,
    directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    **options: Any,
) -> MegatronFSDP:
    """Build ``model_class`` (a transformers model class, e.g. ``LlamaForCausalLM``, or an
    Auto class, e.g. ``AutoModelForCausalLM``) from the config in ``directory`` on the
    meta device, shard it with ``fully_shard_model(model, **options)`` and load each
    rank's piece of the weights from the directory's safetensors (written by
    ``save_pretrained``: single file or sharded index, any dtype; cast to ``dtype``,
    the parameters' and so the main weights' dtype). Returns the wrapper, as
    ``fully_shard_model`` does. ``fsdp_unit_modules`` defaults to the model's
    ``_no_split_modules`` (its blocks). The model is returned in eval mode, as
    transformers returns it (dropout off): call ``.train()`` before training. See the
    module note for the guarantees."""
    if "init_model_with_meta_device" in options:
        raise TypeError(
            "from_pretrained builds the model on the meta device itself; do not pass "
            "init_model_with_meta_device"
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"from_pretrained: dtype must be a floating torch.dtype; got {dtype!r}")
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"from_pretrained: {directory} is not a directory (a local save_pretrained "
            f"directory is read; nothing is downloaded)"
        )
    model = _build_on_meta(model_class, directory, dtype)
    if options.get("fsdp_unit_modules") is None:
        options["fsdp_unit_modules"] = _default_units(model)
    wrapper = fully_shard_model(model, init_model_with_meta_device=True, **options)
    load_pretrained_weights(wrapper, directory)
    wrapper.eval()  # as transformers' from_pretrained returns it: call .train() to train
    return wrapper
