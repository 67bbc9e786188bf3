"""Sharding strategies: which training state each data-parallel rank holds only a shard of.

The values and names are Megatron-FSDP's (``zero_dp_strategy=3`` or
``"optim_grads_params"``), so configurations written for ``megatron_fsdp.fully_shard``
parse unchanged. Each strategy shards everything the one before it shards:

============  ======================  =====================================================
value         Megatron name           sharded across the data-parallel group
============  ======================  =====================================================
0             ``no_shard``            nothing (plain data parallel, gradients all-reduced)
1             ``optim``               optimizer state and fp32 main weights (ZeRO-1)
2             ``optim_grads``         ... and main gradients (ZeRO-2)
3             ``optim_grads_params``  ... and the compute weights (ZeRO-3)
============  ======================  =====================================================

:meth:`ShardingStrategy.parse` also accepts the ZeRO stage names ``"zero1"``,
``"zero2"`` and ``"zero3"`` (``"ZeRO-3"`` and ``"zero_3"`` too), because papers and
DeepSpeed users speak of stages. ``no_shard`` has no ZeRO alias: DeepSpeed's "stage 0"
means "ZeRO off", which is a statement about DeepSpeed, not a stage of ZeRO.
"""

from __future__ import annotations

import enum
import numbers

__all__ = ["ShardingStrategy"]


class ShardingStrategy(enum.IntEnum):
    """How much of the training state is sharded; see the module docstring for the table."""

    NO_SHARD = 0
    OPTIM = 1
    OPTIM_GRADS = 2
    OPTIM_GRADS_PARAMS = 3

    @property
    def megatron_name(self) -> str:
        """The name Megatron-FSDP uses for this strategy, e.g. ``"optim_grads_params"``."""
        return self.name.lower()

    @property
    def shards_main_weights(self) -> bool:
        """Whether main (fp32) weights and optimizer state are sharded (``optim`` and up)."""
        return self >= ShardingStrategy.OPTIM

    @property
    def shards_grads(self) -> bool:
        """Whether main gradients are sharded, i.e. reduce-scattered (``optim_grads`` and up)."""
        return self >= ShardingStrategy.OPTIM_GRADS

    @property
    def shards_model_weights(self) -> bool:
        """Whether the compute weights are sharded and all-gathered around use (ZeRO-3)."""
        return self == ShardingStrategy.OPTIM_GRADS_PARAMS

    @classmethod
    def parse(cls, value: ShardingStrategy | int | str) -> ShardingStrategy:
        """Return the strategy ``value`` names.

        Accepted: a :class:`ShardingStrategy`; an integer 0..3 (``bool`` is refused even
        though it is an ``int``, since ``True`` is almost certainly a mistake); a Megatron
        name in any case (``"no_shard"``, ``"optim"``, ``"optim_grads"``,
        ``"optim_grads_params"``); or a ZeRO stage alias ``"zero1"``/``"zero2"``/``"zero3"``
        in any case, optionally with ``-`` or ``_`` before the digit. Anything else raises
        ``ValueError`` listing every allowed value.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, bool):
            raise ValueError(_invalid_message(value, "a bool is not a strategy"))
        if isinstance(value, numbers.Integral):  # int, numpy integers
            try:
                return cls(int(value))
            except ValueError:
                raise ValueError(_invalid_message(value, "integers must be 0..3")) from None
        if isinstance(value, str):
            strategy = _BY_NAME.get(value.lower())
            if strategy is None:
                raise ValueError(_invalid_message(value, "unknown name"))
            return strategy
        raise ValueError(_invalid_message(value, f"unsupported type {type(value).__name__}"))


# Lower-case spelling -> strategy, for parse(). Built once; parse() sits on setup paths only.
_BY_NAME: dict[str, ShardingStrategy] = {s.megatron_name: s for s in ShardingStrategy}
for _stage, _strategy in (
    (1, ShardingStrategy.OPTIM),
    (2, ShardingStrategy.OPTIM_GRADS),
    (3, ShardingStrategy.OPTIM_GRADS_PARAMS),
):
    for _sep in ("", "-", "_"):
        _BY_NAME[f"zero{_sep}{_stage}"] = _strategy
del _stage, _strategy, _sep

_ALLOWED = (
    "a ShardingStrategy member, an integer 0..3, a Megatron-FSDP name (any case: "
    + ", ".join(repr(s.megatron_name) for s in ShardingStrategy)
    + "), or a ZeRO stage alias (any case: 'zero1', 'zero2', 'zero3', also written "
    "'zero-3' or 'zero_3')"
)


def _invalid_message(value: object, reason: str) -> str:
    return f"Invalid sharding strategy {value!r} ({reason}); expected {_ALLOWED}."
