"""A ``save_checkpoint`` directory to a Hugging Face ``save_pretrained`` directory.

The checkpoint holds the model's in-memory names and shapes (transformers 5 fuses some
on-disk tensors, e.g. per-expert weights, into 3-D ones); transformers' own
``save_pretrained(state_dict=...)`` writes them back under the on-disk names (its
reverse conversion mapping), sharded with an index past ``max_shard_size``. The model
class comes from the config's ``architectures`` and is built on the meta device: no
weights are allocated beyond the consolidated state dict. transformers is an optional
client (dependency group ``hf``), imported only here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from fsdp_ckpt.consolidate import read_full_model_state

__all__ = ["export_hf_checkpoint"]


def export_hf_checkpoint(
    checkpoint: str | os.PathLike[str],
    config_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    max_shard_size: str | int = "5GB",
) -> dict[str, int]:
    """Write ``checkpoint`` (a ``save_checkpoint`` directory of a transformers model) to
    ``output`` as ``save_pretrained`` would, with the config found in ``config_dir``
    (the model's original ``save_pretrained`` directory, or any holding its
    ``config.json``). Runs in this process alone. Returns ``{"tensors": n}``."""
    if not (Path(config_dir) / "config.json").is_file():  # before anything is read or written
        raise FileNotFoundError(
            f"{config_dir} holds no config.json: give the model's save_pretrained "
            "directory (or any directory holding its config.json)"
        )
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "fsdp-consolidate --hf needs transformers (>=5): `uv sync --group hf` or "
            "`pip install 'transformers>=5'`"
        ) from e
    config = transformers.AutoConfig.from_pretrained(config_dir, local_files_only=True)
    names = getattr(config, "architectures", None) or []
    classes = [getattr(transformers, n, None) for n in names]
    if len(classes) != 1 or classes[0] is None:
        raise ValueError(
            f"{Path(config_dir) / 'config.json'}: 'architectures' must name one transformers "
            f"model class; got {names}"
        )
    full = read_full_model_state(checkpoint)
    with torch.device("meta"):
        model = classes[0]._from_config(config)
    expected = set(model.state_dict())
    if set(full) != expected:
        extra, missing = sorted(set(full) - expected), sorted(expected - set(full))
        raise ValueError(
            f"{checkpoint} does not hold a {type(model).__name__} of this config: entries "
            f"not in the model {extra[:10]}, entries missing {missing[:10]}"
        )
    state: dict[str, Any] = dict(full)
    model.save_pretrained(output, state_dict=state, max_shard_size=max_shard_size)
    return {"tensors": len(state)}
