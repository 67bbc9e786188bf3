"""Models named by a Hugging Face config, built on the meta device (no weights).

A ``config.json`` path (or a directory holding one) is read with
``AutoConfig.from_pretrained`` (local files only); a bare name that is a
``transformers`` model type (``llama``, ``mistral``, ...) gets that type's default
config. transformers is imported only here, and only when asked for.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

__all__ = ["hf_builder", "tp_local"]


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


# transformers' tensor-parallel styles: the dim of ``weight`` (and of ``bias``; None:
# replicated) each splits.
_TP_STYLES = {
    "colwise": (0, 0),
    "colwise_gather_output": (0, 0),
    "rowwise": (1, None),
    "embedding_rowwise": (0, None),
}


def tp_local(model: nn.Module, tp: int) -> nn.Module:
    """``model`` (on the meta device) as one of ``tp`` tensor-parallel ranks holds it
    under its ``_tp_plan`` (transformers' ``base_model_tp_plan``): each planned module's
    weight (and bias) replaced by rank 0's ``torch.chunk`` piece, marked as Megatron-Core
    marks tp-local parameters (``tensor_model_parallel``, ``partition_dim``), which is
    what ``plan(tp=...)`` reads; everything else stays whole (replicated over tp)."""
    tp_plan = getattr(model, "_tp_plan", None) or {}
    if not tp_plan:
        raise SystemExit(
            f"fsdp-plan: {type(model).__name__} has no tensor-parallel plan (_tp_plan); "
            "--tp needs one, or a module.path:factory that builds one tp rank's module"
        )
    rules = [(re.compile(re.escape(k).replace(r"\*", r"\d+") + "$"), v) for k, v in tp_plan.items()]
    done: dict[int, nn.Parameter] = {}
    for name, module in model.named_modules():
        style = next((v for pattern, v in rules if pattern.match(name)), None)
        if style is None:
            continue
        if style not in _TP_STYLES:
            raise SystemExit(
                f"fsdp-plan: tensor-parallel style {style!r} of {name!r} is not one --tp "
                f"knows; known: {sorted(_TP_STYLES)}"
            )
        for attr, dim in zip(("weight", "bias"), _TP_STYLES[style], strict=True):
            p = module._parameters.get(attr)
            if p is None or dim is None:
                continue
            if id(p) not in done:  # a tied weight keeps the first style that splits it
                rows = -(-p.shape[dim] // tp)  # torch.chunk: rank 0 holds the most
                shape = (*p.shape[:dim], rows, *p.shape[dim + 1 :])
                local = nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"))
                local.requires_grad_(p.requires_grad)
                local.tensor_model_parallel, local.partition_dim = True, dim  # type: ignore[attr-defined]
                local.partition_stride = 1  # type: ignore[attr-defined]
                done[id(p)] = local
            module._parameters[attr] = done[id(p)]
    return model


def hf_builder(
    spec: str, tp: int = 1
) -> tuple[Callable[[], nn.Module], list[type[nn.Module]], torch.dtype]:
    """``(build, unit classes, dtype)`` for the causal-LM model of config ``spec``:
    ``build()`` makes it on the meta device (as one of ``tp`` tensor-parallel ranks holds
    it, ``tp_local``); the units are its ``_no_split_modules`` (its decoder layers); the
    dtype is the config's (fp32 when it names none)."""
    from transformers import AutoModelForCausalLM

    config = _config(spec)
    dtype = getattr(config, "dtype", None)  # transformers >= 5 (the hf group's pin)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32

    def build() -> nn.Module:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config).to(dtype)
        return tp_local(model, tp) if tp > 1 else model

    probe = build()
    wanted = set(getattr(probe, "_no_split_modules", None) or ())
    units = sorted({type(m) for m in probe.modules() if type(m).__name__ in wanted}, key=str)
    return build, units, dtype
