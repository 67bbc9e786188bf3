"""Where a checkpoint keeps the model and the optimizer among its DCP keys.

``save_checkpoint`` writes ``model.<name>`` and ``optim.<...>``: the layout of
``dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, o)})``
with torch's ``torch.distributed.checkpoint.state_dict`` functions. Checkpoints that
FSDP2 users write themselves put the same two state dicts under other top-level keys
("optimizer", "app.model" as in DCP's tutorial, the model at the top level as in
torchtitan) and may flatten the optimizer's param groups to
``param_groups.<name>.<hyperparameter>`` (``flatten_optimizer_state_dict=True``).
``detect_layout`` reads which from the keys: the model's prefix is the one under which
most of the model's own state dict keys appear, the optimizer's the one in front of
``param_groups.``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fsdp_ckpt.errors import CheckpointMismatchError

__all__ = ["OURS", "Layout", "detect_layout"]

_STATE = "state."
_GROUPS = "param_groups."
_SHOWN = 8


@dataclass(frozen=True)
class Layout:
    model_prefix: str  # "model.", "" for a model state dict at the top level
    optim_prefix: str | None  # "optim."; None: the checkpoint has no optimizer state
    groups_by_name: bool = False  # param groups as "param_groups.<fqn>.<hyperparameter>"

    def is_optim_key(self, key: str) -> bool:
        p = self.optim_prefix
        return p is not None and (key.startswith(p + _STATE) or key.startswith(p + _GROUPS))

    def model_entries(self, metadata: Metadata) -> dict[str, object]:
        """The checkpoint's entries that belong to the model. At the top level (no
        prefix) only tensors count: there the model shares the namespace with the
        optimizer and whatever else was saved (a scheduler, a data loader, a step)."""
        return {
            k: md
            for k, md in metadata.state_dict_metadata.items()
            if k.startswith(self.model_prefix)
            and not self.is_optim_key(k)
            and (self.model_prefix or isinstance(md, TensorStorageMetadata))
        }


OURS = Layout(model_prefix="model.", optim_prefix="optim.")


def _optim_prefixes(keys: Iterable[str]) -> set[str]:
    """Every prefix that stands in front of a ``param_groups.`` component."""
    out: set[str] = set()
    for key in keys:
        i = key.find(_GROUPS)
        while i >= 0:
            if i == 0 or key[i - 1] == ".":
                out.add(key[:i])
            i = key.find(_GROUPS, i + 1)
    return out


def _model_prefix(keys: Iterable[str], model_keys: Collection[str]) -> str | None:
    """The prefix under which most of ``model_keys`` appear among ``keys``."""
    counts: Counter[str] = Counter()
    for key in keys:
        start = 0
        while True:
            if key[start:] in model_keys:
                counts[key[:start]] += 1
            dot = key.find(".", start)
            if dot < 0:
                break
            start = dot + 1
    if not counts:
        return None
    # Ties (a model key that is also another key's suffix) go to the usual names.
    return max(counts, key=lambda p: (counts[p], p in ("model.", ""), -len(p)))


def _choose_optim_prefix(keys: list[str], want: bool, directory: object) -> str | None:
    candidates = _optim_prefixes(keys)
    if len(candidates) == 1:
        return next(iter(candidates))
    # Several optimizers: the conventional name wins; otherwise the caller must say.
    known = [p for p in ("optim.", "optimizer.") if p in candidates]
    if known or not want:
        return known[0] if known else None
    if not candidates:
        raise CheckpointMismatchError(
            f"{directory} holds no optimizer state; load it without an optimizer"
        )
    raise CheckpointMismatchError(
        f"{directory} holds several optimizer state dicts (under {sorted(candidates)}) "
        f"and none under 'optim.' or 'optimizer.'; load the model alone and the "
        f"optimizer with dcp.load and fsdp_ckpt.set_optimizer_state_dict"
    )


def detect_layout(
    metadata: Metadata, model_keys: Collection[str], directory: object, *, want_optimizer: bool
) -> Layout:
    """The layout of a checkpoint that ``save_checkpoint`` did not write (see the
    module note). Raises, naming keys, when the model's entries cannot be found, or
    the optimizer's when ``want_optimizer``."""
    keys = list(metadata.state_dict_metadata)
    optim_prefix = _choose_optim_prefix(keys, want_optimizer, directory)
    layout = Layout("", optim_prefix)
    found = _model_prefix((k for k in keys if not layout.is_optim_key(k)), set(model_keys))
    if found is None:
        raise CheckpointMismatchError(
            f"none of the model's {len(model_keys)} state dict keys (e.g. "
            f"{sorted(model_keys)[:_SHOWN]}) appear in the DCP checkpoint {directory}, "
            f"under any prefix; it holds e.g. {keys[:_SHOWN]}"
        )
    # Indexed groups always hold their "params" list; groups flattened per parameter
    # have none (and a parameter name may start with a digit, as in nn.Sequential).
    by_name = optim_prefix is not None and not any(
        k.startswith(optim_prefix + _GROUPS) and k.endswith(".params") for k in keys
    )
    return Layout(found, optim_prefix, by_name)
