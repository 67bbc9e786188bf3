"""Models named by a Hugging Face config, built on the meta device (no weights).

A ``config.json`` path (or a directory holding one) is read with
``AutoConfig.from_pretrained`` (local files only); a bare name that is a
``transformers`` model type (``llama``, ``mistral``, ...) gets that type's default
config. transformers is imported only here, and only when asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

__all__ = ["hf_builder"]


def _config(spec: str):
    try:
        from transformers import CONFIG_MAPPING, AutoConfig
    except ImportError as err:
        raise SystemExit(
            f"fsdp-plan: {spec!r} is not module.path:factory, and reading a Hugging Face "
            f"config needs transformers ({err}); install it (uv sync --group hf)"
        ) from err
    path = Path(spec)
    if path.name == "config.json" and path.is_file():
        path = path.parent
    if path.is_dir() and (path / "config.json").is_file():
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    if spec in CONFIG_MAPPING:
        return CONFIG_MAPPING[spec]()
    raise SystemExit(
        f"fsdp-plan: model {spec!r} is neither module.path:factory, a config.json (or a "
        f"directory with one), nor a transformers model type such as 'llama'"
    )


def hf_builder(spec: str) -> tuple[Callable[[], nn.Module], list[type[nn.Module]], torch.dtype]:
    """``(build, unit classes, dtype)`` for the causal-LM model of config ``spec``:
    ``build()`` makes it on the meta device; the units are its ``_no_split_modules``
    (its decoder layers); the dtype is the config's (fp32 when it names none)."""
    from transformers import AutoModelForCausalLM

    config = _config(spec)
    dtype = getattr(config, "dtype", None)  # transformers >= 5 (the hf group's pin)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32

    def build() -> nn.Module:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config).to(dtype)

    probe = build()
    wanted = set(getattr(probe, "_no_split_modules", None) or ())
    units = sorted({type(m) for m in probe.modules() if type(m).__name__ in wanted}, key=str)
    return build, units, dtype
