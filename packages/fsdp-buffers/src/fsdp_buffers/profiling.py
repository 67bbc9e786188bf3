"""Profiler labels for fsdp's runtime steps, visible in Nsight Systems and torch.profiler.

Every gather, release and reduce runs under :func:`annotate`, which opens an NVTX range
in the ``"fsdp"`` domain and a ``torch.profiler.record_function`` range. It runs per
bucket per step, so the idle path must cost next to nothing:

- NVTX: the ``"fsdp"`` domain is created once at import. With no NVTX tool attached
  (no Nsight) the ``nvtx`` package hands back a dummy domain, and we skip NVTX
  entirely; with one attached, the event attributes for each label are built once
  and cached, so a range is one push and one pop.
- record_function costs about 5 us per enter/exit even with no profiler running, so it
  is opened only while a torch profiler is active (``torch.autograd._profiler_enabled()``,
  about 50 ns to ask). A profiler started inside an open range sees only later ranges.

Measured on CPU with neither tool attached: about 0.36 us per ``with annotate(...)``
(a ``with contextlib.nullcontext()`` costs 0.21 us), against about 4.8 us for a bare
``record_function``. An enter with no profiler appends nothing (a depth counter tells
which exits close a range): a flag check and a counter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import nvtx
import torch
from torch.profiler import record_function

__all__ = ["NVTX_DOMAIN", "annotate"]

NVTX_DOMAIN = "fsdp"

# None when no NVTX tool is attached (or NVTX_DISABLE is set): then NVTX is skipped.
_nvtx_domain: nvtx.Domain | None = None
if nvtx.enabled():
    _domain = nvtx.get_domain(NVTX_DOMAIN)
    if isinstance(_domain, nvtx.Domain):  # not the dummy returned when no tool listens
        _nvtx_domain = _domain
    del _domain

_nvtx_attributes: dict[str, Any] = {}  # label -> cached nvtx EventAttributes

_profiler_enabled: Callable[[], bool] = torch.autograd._profiler_enabled

_F = TypeVar("_F", bound=Callable[..., Any])


class annotate:
    """Label a region for Nsight (NVTX domain ``"fsdp"``) and torch.profiler.

    Use as a context manager, ``with annotate("fsdp.all_gather"): ...``, or as a
    decorator, ``@annotate("fsdp.reduce")``; a decorated function opens a fresh range
    per call, so it is safe under recursion and from several threads. One context
    object may be re-entered while open, and used by one thread after another (the hook
    layer and each bucket make theirs once), but not entered by two threads at once.
    """

    # ``_depth``: how many enters are open; ``_opened``: (depth, record_function) of those
    # that opened a torch.profiler range (made on the first), so an enter with no
    # profiler costs a flag check and a counter, and its exit closes nothing.
    __slots__ = ("_depth", "_label", "_nvtx_attrs", "_opened")

    def __init__(self, label: str) -> None:
        if not isinstance(label, str):
            raise TypeError(
                f"annotate() takes a str label such as 'fsdp.all_gather', got "
                f"{type(label).__name__} {label!r}."
            )
        if not label:
            raise ValueError("annotate() needs a non-empty label, such as 'fsdp.all_gather'.")
        self._label = label
        self._nvtx_attrs = _nvtx_event_attributes(label) if _nvtx_domain is not None else None
        self._depth = 0
        self._opened: list[tuple[int, record_function]] | None = None

    def __enter__(self) -> annotate:
        if self._nvtx_attrs is not None:
            _nvtx_domain.push_range(self._nvtx_attrs)  # type: ignore[union-attr]
        self._depth = depth = self._depth + 1
        if _profiler_enabled():
            rf = record_function(self._label)
            rf.__enter__()
            if self._opened is None:
                self._opened = []
            self._opened.append((depth, rf))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        opened = self._opened
        if opened and opened[-1][0] == self._depth:
            opened.pop()[1].__exit__(exc_type, exc, tb)
        self._depth -= 1
        if self._nvtx_attrs is not None:
            _nvtx_domain.pop_range()  # type: ignore[union-attr]

    @property
    def open_ranges(self) -> int:
        """How many torch.profiler ranges this object has open (for tests)."""
        return len(self._opened or ())

    def __call__(self, func: _F) -> _F:
        label = self._label

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with annotate(label):
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


def _nvtx_event_attributes(label: str) -> Any:
    attrs = _nvtx_attributes.get(label)
    if attrs is None:
        attrs = _nvtx_domain.get_event_attributes(message=label)  # type: ignore[union-attr]
        _nvtx_attributes[label] = attrs
    return attrs
