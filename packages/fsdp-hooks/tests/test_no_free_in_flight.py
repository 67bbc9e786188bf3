"""No memory is freed under a collective that may still use it.

gloo and NCCL write a collective's output after the call has returned, until the work
is waited on. fsdp frees bucket memory with ``storage.resize_(0)`` (the module note of
``fsdp_buffers.data_parallel_buffer``), which releases it whoever still points at it.
Freed under an unfinished all-gather or reduction, the memory is written after the
allocator has handed it out again (heap corruption on CPU, wrong values on CUDA); read
after it, the collective sends whatever the new owner wrote. Either happens only when
the timing is unlucky.

So the check does not depend on timing. Every collective a rank starts through a
process group's methods is watched until its caller waits on it (or is told it has
completed). A storage that shrinks while a watched collective reads or writes it fails the
rank, naming the collective and where both calls came from. Training steps run under
ZeRO-1/2/3, with unit coalescing, prefetch two deep, double buffering, gradients
communicated in another dtype or staged in ``main_grad``, microbatches, hybrid sharding
and gradient clipping.

On CUDA the same rule has a stream half (Note [streams and frees] in
``fsdp_buffers.collectives``): a collective runs on its own stream, so memory is free
for reuse only once the stream that allocated it is ordered after every stream that
reads it, a gathered bucket is read on the compute stream only after that stream
waited on its gather, and the main grads a reduction's follow-up writes on the reduce
stream are read or written on compute only after compute waited on an event recorded
after that follow-up. The same training runs with a ``StreamRecorder`` as the buffer's
stream operations (no streams here: it logs what the context orders), and
``StreamRecorder.check`` fails the rank on the first read before its wait, free before
its order, or launch before its stream waited on compute. A context that frees without
ordering is caught (``test_a_free_without_its_stream_order_is_caught``).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from fsdp_buffers import MixedPrecisionPolicy
from fsdp_buffers.collectives import CommContext, StreamKind, all_gather
from fsdp_buffers.stream_recorder import StreamRecorder
from fsdp_hooks import fully_shard
from fsdp_mesh import build_device_mesh
from fsdp_mesh.testing import run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig, token_batch

CFG = GPTConfig(vocab_size=48, max_seq_len=8, dim=16, n_heads=2, n_layers=4)
K = 2  # microbatches per step
M = 2  # rows per microbatch per rank

# Process-group methods whose tensors a collective reads or writes after the call.
_COLLECTIVES = (
    "_allgather_base",
    "all_gather_single",
    "allgather",
    "allgather_into_tensor_coalesced",
    "_reduce_scatter_base",
    "reduce_scatter_single",
    "reduce_scatter",
    "reduce_scatter_tensor_coalesced",
    "allreduce",
    "allreduce_coalesced",
    "broadcast",
    "reduce",
    "alltoall_base",
    "all_to_all_single",
    "alltoall",
    "gather",
    "scatter",
    "send",
    "recv",
)


class _Watched:
    """A collective's work, in flight until someone waits on it or sees it complete."""

    __slots__ = ("extents", "finished", "name", "started_at", "work")

    def __init__(self, work: dist.Work, name: str, extents: list[tuple[int, int]]) -> None:
        self.work, self.name, self.extents = work, name, extents
        self.finished = False
        self.started_at = "".join(traceback.format_stack(limit=10)[:-2])

    def wait(self, *args, **kwargs):
        result = self.work.wait(*args, **kwargs)
        self.finished = True
        return result

    def is_completed(self) -> bool:
        done = self.work.is_completed()
        self.finished = self.finished or done
        return done

    def __getattr__(self, name: str):
        return getattr(self.work, name)


def _extents(obj, into: list[tuple[int, int]]) -> None:
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.nbytes():
            into.append((storage.data_ptr(), storage.nbytes()))
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _extents(item, into)


@contextlib.contextmanager
def watch_frees() -> Iterator[set[str]]:
    """Fail a storage shrink under an unwaited collective that uses the storage; yields
    the names of the collectives watched (so a run can show it watched something)."""
    in_flight: list[_Watched] = []
    names: set[str] = set()
    pg = dist.ProcessGroup
    originals = {}

    def wrap(name: str):
        original = originals[name] = getattr(pg, name)

        def call(self, *args, **kwargs):
            work = original(self, *args, **kwargs)
            if work is None:
                return work
            extents: list[tuple[int, int]] = []
            _extents(list(args), extents)
            watched = _Watched(work, name, extents)
            in_flight[:] = [w for w in in_flight if not w.finished]
            in_flight.append(watched)
            names.add(name)
            return watched

        setattr(pg, name, call)

    for name in _COLLECTIVES:
        if hasattr(pg, name):
            wrap(name)
    resize = torch.UntypedStorage.resize_

    def checked_resize(self, size):
        if size < self.nbytes():
            start, end = self.data_ptr(), self.data_ptr() + self.nbytes()
            for w in in_flight:
                if not w.finished and any(p < end and start < p + n for p, n in w.extents):
                    freed_at = "".join(traceback.format_stack(limit=10)[:-1])
                    raise AssertionError(
                        f"a storage of {self.nbytes()} bytes was shrunk to {size} while "
                        f"{w.name}, not yet waited on, reads or writes it.\n"
                        f"Collective started at:\n{w.started_at}\nShrunk at:\n{freed_at}"
                    )
        return resize(self, size)

    torch.UntypedStorage.resize_ = checked_resize
    try:
        yield names
    finally:
        torch.UntypedStorage.resize_ = resize
        for name, original in originals.items():
            setattr(pg, name, original)


def _catches_a_free_under_a_gather() -> str:
    with watch_frees():
        out = torch.empty(2 * 64)
        work = all_gather(out, torch.ones(64), dist.group.WORLD)
        try:
            out.untyped_storage().resize_(0)
        except AssertionError as err:
            message = str(err)
        else:
            message = ""
        work.wait()
    return message


def test_the_watch_catches_a_free_under_a_gather():
    for message in run_distributed(_catches_a_free_under_a_gather, 2):
        assert "while _allgather_base" in message or "while all_gather_single" in message, message
        assert "not yet waited on" in message


SCENARIOS = {
    "zero1": {"zero_dp_strategy": 1},
    "zero2": {"zero_dp_strategy": 2},
    "zero3": {"zero_dp_strategy": 3},
    "zero3_deep": {"zero_dp_strategy": 3, "prefetch_depth": 2},
    "zero3_units": {"zero_dp_strategy": 3, "suggested_communication_unit_size": 0},
    "zero3_double": {"zero_dp_strategy": 3, "fsdp_double_buffer": True},
    "zero3_bf16comm": {
        "zero_dp_strategy": 3,
        "mixed_precision_policy": MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16),
    },
    # Gradients staged in main_grad (the Megatron-Core adapters'): the replicated
    # buffer reduced in place (ZeRO-1), staging buckets packed and freed (ZeRO-3).
    "zero1_main_grad": {"zero_dp_strategy": 1, "grad_staging": "main_grad"},
    "zero3_main_grad": {"zero_dp_strategy": 3, "grad_staging": "main_grad"},
    "zero2_bf16comm": {
        "zero_dp_strategy": 2,
        "mixed_precision_policy": MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16),
    },
}
HYBRID = {
    "hsdp_zero3": {"zero_dp_strategy": 3, "outer_dp_sharding_strategy": "no_shard"},
    "full_zero3": {"zero_dp_strategy": 3, "outer_dp_sharding_strategy": "optim"},
}


class _FreeWithoutOrder(CommContext):
    """A context that forgets the free rule's wait (what the recorder must catch)."""

    def free(self, allocated_on: StreamKind, used_by: StreamKind, gid: int, what: str) -> None:
        self.note("free", allocated_on, gid, what, used_by)


def _train(kwargs: dict, hybrid: bool, context: type[CommContext] = CommContext) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    module = GPT(CFG)
    kwargs = {"fsdp_unit_modules": [Block], **kwargs}
    if hybrid:
        kwargs["device_mesh"] = build_device_mesh(dp_outer=2, dp_shard=2).device_mesh
        kwargs["dp_shard_dim"], kwargs["dp_outer_dim"] = "dp_shard", "dp_outer"
    with watch_frees() as names:
        model, opt = fully_shard(module, torch.optim.AdamW(module.parameters(), lr=1e-2), **kwargs)
        streams = StreamRecorder()
        model.buffer.comm = context(model.buffer.device, streams)
        for step in range(3):
            x, y = token_batch(step, world * K * M, CFG.max_seq_len, CFG.vocab_size)
            for j in range(K):
                start = rank * K * M + j * M
                rows = slice(start, start + M)
                loss = F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten()) / K
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=step != 1)
        with torch.no_grad():  # a forward with no backward releases what it gathered
            model(x[:M])
    streams.check()
    # The recorder saw the gathers and reductions it checks.
    if kwargs["zero_dp_strategy"] == 3:
        assert streams.count("launch", StreamKind.GATHER) > 0, streams.ops[:5]
        assert streams.count("free", StreamKind.GATHER) > 0, streams.ops[:5]
    assert streams.count("launch", StreamKind.REDUCE) > 0, streams.ops[:5]
    # Follow-ups ran on the reduce stream, and compute's reads and writes of the main
    # grads (the optimizer's, zero_grad's) were checked against them.
    assert streams.count("wait", StreamKind.REDUCE) == streams.count("launch", StreamKind.REDUCE)
    assert any(o.what == "main grads" and o.op == "read" for o in streams.ops), streams.ops[:5]
    return sorted(names)


def _each(scenarios: dict, hybrid: bool) -> dict[str, list[str]]:
    return {name: _train(kwargs, hybrid) for name, kwargs in scenarios.items()}


@pytest.mark.parametrize(
    ("world", "scenarios", "hybrid"), [(2, SCENARIOS, False), (4, HYBRID, True)]
)
def test_no_storage_is_freed_under_a_collective_in_flight(world, scenarios, hybrid):
    results = run_distributed(_each, world, args=(scenarios, hybrid), timeout=120)
    for watched in results:
        for name, seen in watched.items():
            # The watch saw the gathers and reductions it is meant to check.
            assert any("gather" in s for s in seen) and any("reduce" in s for s in seen), (
                name,
                seen,
            )


def _caught(kwargs: dict) -> str:
    try:
        _train(kwargs, False, _FreeWithoutOrder)
    except AssertionError as err:
        return str(err)
    return ""


@pytest.mark.parametrize("kwargs", [SCENARIOS["zero3"], SCENARIOS["zero3_double"]])
def test_a_free_without_its_stream_order_is_caught(kwargs):
    for message in run_distributed(_caught, 2, args=(kwargs,), timeout=60):
        assert "before gather waited on compute's last read" in message, message
