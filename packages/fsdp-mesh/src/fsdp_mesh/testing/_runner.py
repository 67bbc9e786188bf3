"""Run one function on N ranks, each in its own process, under a deadline.

Note on process start-up. Importing torch costs seconds per process on a small CPU
machine, and a test suite starts hundreds of ranks. Ranks are therefore started with
the ``forkserver`` method: a clean server process (no pytest state, no threads) is
spawned once, imports torch once, and forks one child per rank. Each rank still begins
from a fresh interpreter state as with ``spawn``; only the import is shared.
``start_method="spawn"`` is available for code that must not share even that.

Every rank sends its result or its traceback back through a pipe. The parent waits on
those pipes and on the process sentinels together, so a rank that exits without a word
is seen at once. When one rank fails, the others get a short grace period to report
(they are usually blocked in a collective waiting for the failed one) and are then
killed. When the deadline passes, the ranks that have not finished get SIGUSR1, which
makes ``faulthandler`` write their Python stacks into their logs, and are killed; the
error names them and shows those stacks. Each rank leads its own process group, and
the end of a run kills the groups, so nothing a rank forked outlives the run.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import importlib.util
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "TEST_DEVICE_ENV",
    "DistributedTestError",
    "DistributedTestTimeout",
    "RankFailure",
    "harness_device",
    "harness_device_type",
    "run_distributed",
    "world_sizes",
]

# Selects the device the tests run on: "cpu" (gloo; the default) or "cuda" (NCCL, one
# GPU per rank). The root conftest's ``--fsdp-device`` option sets it.
TEST_DEVICE_ENV = "FSDP_TEST_DEVICE"
_TEST_DEVICE_TYPES = ("cpu", "cuda")

# Modules the fork server imports once, so that ranks start in milliseconds.
_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    # DTensor.from_local imports torch._dynamo lazily: seconds per rank otherwise.
    "torch._dynamo",
    "torch.nn",
    "pytest",
    "hypothesis",
)
_FAILURE_GRACE_S = 5.0
_KILL_GRACE_S = 2.0
_STACK_DUMP_WAIT_S = 0.5
_LOG_TAIL_CHARS = 6000


@dataclass(frozen=True)
class RankFailure:
    """What one rank left behind when it did not return a result."""

    rank: int
    reason: str
    traceback: str = ""
    log_tail: str = ""

    def describe(self) -> str:
        parts = [f"--- rank {self.rank}: {self.reason}"]
        if self.traceback:
            parts.append(self.traceback.rstrip())
        if self.log_tail.strip():
            parts.append(f"--- rank {self.rank} output (tail):\n{self.log_tail.rstrip()}")
        return "\n".join(parts)


class DistributedTestError(AssertionError):
    """One or more ranks raised, exited early, or did not finish."""

    def __init__(self, message: str, failures: list[RankFailure], pids: list[int]):
        super().__init__(message)
        self.failures = failures
        self.pids = pids

    @property
    def failed_ranks(self) -> list[int]:
        return sorted(f.rank for f in self.failures)


class DistributedTestTimeout(DistributedTestError):
    """Some ranks were still running at the deadline; ``hung_ranks`` names them."""

    def __init__(
        self, message: str, failures: list[RankFailure], pids: list[int], hung_ranks: list[int]
    ):
        super().__init__(message, failures, pids)
        self.hung_ranks = hung_ranks


@dataclass(frozen=True)
class _FunctionRef:
    """How a rank finds the function: by module name, or by file when the module
    cannot be imported by name (pytest's importlib mode gives test files such names)."""

    module: str
    file: str | None
    qualname: str

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> _FunctionRef:
        qualname = getattr(fn, "__qualname__", None)
        module = getattr(fn, "__module__", None)
        if qualname is None or module is None or "<" in qualname:
            raise TypeError(
                f"run_distributed needs a module-level function so that every rank can "
                f"import it; got {fn!r} (lambdas, nested functions and bound methods of "
                f"local objects are not allowed)"
            )
        code = getattr(fn, "__code__", None)
        return cls(module=module, file=code.co_filename if code else None, qualname=qualname)

    def resolve(self) -> Callable[..., Any]:
        module = None
        with contextlib.suppress(ImportError):
            candidate = importlib.import_module(self.module)
            if self.file is None or _same_file(getattr(candidate, "__file__", None), self.file):
                module = candidate
        if module is None:
            if self.file is None:
                raise ImportError(f"cannot import module {self.module!r} on this rank")
            name = f"_fsdp_rank_module_{abs(hash(self.file))}"
            spec = importlib.util.spec_from_file_location(name, self.file)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {self.file!r} on this rank")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        obj: Any = module
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj


def _same_file(a: str | None, b: str) -> bool:
    return a is not None and os.path.realpath(a) == os.path.realpath(b)


def harness_device_type() -> str:
    """The device type the tests were asked to run on: ``$FSDP_TEST_DEVICE``, "cpu"
    when unset. ``run_distributed`` uses it when its ``device_type`` is None."""
    value = os.environ.get(TEST_DEVICE_ENV, "").strip().lower() or "cpu"
    if value not in _TEST_DEVICE_TYPES:
        raise ValueError(
            f"{TEST_DEVICE_ENV} must be one of {list(_TEST_DEVICE_TYPES)} (or unset for "
            f"'cpu'); got {os.environ[TEST_DEVICE_ENV]!r}"
        )
    return value


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def world_sizes(*sizes: int) -> list[int]:
    """The world sizes a test parametrized over ``sizes`` runs at: all of them on CPU;
    on CUDA (one GPU per rank) those the GPUs allow, or world 1 when none fits, so a
    one-GPU machine still runs the test once."""
    if harness_device_type() != "cuda":
        return list(sizes)
    return [w for w in sizes if w <= _gpu_count()] or [1]


def harness_device() -> torch.device:
    """Where a rank's tensors belong: its GPU under NCCL, the CPU under gloo or outside
    a process group (the test process computing a reference keeps to the CPU unless
    the test moves it, e.g. to ``harness_device_type()``)."""
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _skip(reason: str) -> BaseException:
    """pytest's skip outcome when pytest is there (the harness runs under it), else an
    error that says the same."""
    try:
        import pytest
    except ImportError:
        return RuntimeError(reason)
    return pytest.skip.Exception(reason)


def _pick_device_type(world_size: int, device_type: str | None) -> str:
    if device_type is None:
        # As the tests were asked to run; a world the GPUs cannot hold is a skip, not a
        # silent fall back to CPU.
        device_type = harness_device_type()
        if device_type == "cuda" and _gpu_count() < world_size:
            raise _skip(
                f"{TEST_DEVICE_ENV}=cuda: this test needs {world_size} GPUs (one per rank), "
                f"found {_gpu_count()}"
            )
        return device_type
    if device_type not in _TEST_DEVICE_TYPES:
        raise ValueError(f"device_type must be 'cpu', 'cuda' or None (auto); got {device_type!r}")
    if device_type == "cuda" and _gpu_count() < world_size:
        raise RuntimeError(
            f"device_type='cuda' needs {world_size} CUDA devices, found "
            f"{_gpu_count()}; skip the test or ask for device_type='cpu'"
        )
    return device_type


def _context(start_method: str) -> multiprocessing.context.BaseContext:
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn'; got {start_method!r}")
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        # Effective only before the server first starts; later calls are no-ops.
        ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def _rank_main(
    ref: _FunctionRef,
    rank: int,
    world_size: int,
    port: int,
    device_type: str,
    timeout_s: float,
    log_path: str,
    conn: multiprocessing.connection.Connection,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    env: dict[str, str],
) -> None:
    # Its own process group: what it forks (Megatron-Core's checkpoint writer forks
    # worker processes) is killed with it (``_stop``) instead of outliving the test.
    with contextlib.suppress(OSError, AttributeError):
        os.setpgid(0, 0)
    # Everything this rank prints, and its stack dump on SIGUSR1, goes to its own log.
    log = open(log_path, "w", buffering=1)  # noqa: SIM115 - lives until os._exit
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.enable(file=log)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    os.environ.update(
        {
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            **env,
        }
    )
    status, payload = "error", ""
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        fn = ref.resolve()
        store = dist.TCPStore(
            "127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s)
        )
        device_id = None
        if device_type == "cuda":
            torch.cuda.set_device(rank)
            device_id = torch.device("cuda", rank)
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device_id,
        )
        result = fn(*args, **kwargs)
        payload = _dumps_on_cpu(result)
        status = "ok"
    except BaseException:
        payload = traceback.format_exc()
    try:
        conn.send((status, payload))
        conn.close()
        if status == "ok":
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown: atexit handlers of a half-dead job can hang.
        os._exit(0)


class _CPUPickler(pickle.Pickler):
    """Pickles a rank's result with its tensors moved to the CPU: the test process
    compares them without needing the rank's GPU (and without touching CUDA)."""

    def reducer_override(self, obj: Any) -> Any:
        import torch

        if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            return obj.cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


def _dumps_on_cpu(result: Any) -> bytes:
    buffer = io.BytesIO()
    _CPUPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(result)
    return buffer.getvalue()


def _read_tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-_LOG_TAIL_CHARS:]


def _stop(procs: list[multiprocessing.process.BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _KILL_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    # Then whatever the ranks forked, still in their process groups (a rank's pid is its
    # group's id; just reaped, it is not yet reused).
    for p in procs:
        if p.pid is not None:
            with contextlib.suppress(OSError, AttributeError):
                os.killpg(p.pid, signal.SIGKILL)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    timeout: float = 90.0,
    device_type: str | None = None,
    start_method: str = "forkserver",
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results.

    Each rank is a separate process with ``torch.distributed`` initialised: gloo on
    CPU, nccl when ``device_type`` is "cuda" (rank r then uses GPU r). ``device_type``
    None means as the tests were asked to run (``$FSDP_TEST_DEVICE``, CPU when unset);
    on CUDA, a world larger than the GPU count then skips the test with the reason.
    ``fn`` must be a module-level function, and its arguments and result must pickle
    (tensors in the result come back on the CPU).

    Raises ``DistributedTestError`` (an AssertionError, so pytest shows it as a test
    failure) with every failing rank's traceback when a rank raises or exits without a
    result, and ``DistributedTestTimeout`` naming the ranks still running when
    ``timeout`` seconds have passed. No rank process outlives the call.
    """
    import torch.distributed as dist

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds; got {timeout!r}")
    ref = _FunctionRef.of(fn)
    device_type = _pick_device_type(world_size, device_type)
    ctx = _context(start_method)
    # The parent owns the rendezvous store on a port the OS picks: no port races.
    # Ranks' own collective timeout is longer than ours, so our deadline fires first.
    rank_timeout_s = timeout + 30.0
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size + 1,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=rank_timeout_s),
    )
    logdir = Path(tempfile.mkdtemp(prefix="fsdp_ranks_"))
    procs: list[multiprocessing.process.BaseProcess] = []
    conns: dict[int, multiprocessing.connection.Connection] = {}
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_rank_main,
                name=f"fsdp-rank-{rank}",
                args=(
                    ref,
                    rank,
                    world_size,
                    store.port,
                    device_type,
                    rank_timeout_s,
                    str(logdir / f"rank{rank}.log"),
                    send,
                    tuple(args),
                    dict(kwargs or {}),
                    dict(env or {}),
                ),
                daemon=True,
            )
            p.start()
            send.close()
            procs.append(p)
            conns[rank] = recv
        return _collect(procs, conns, logdir, timeout)
    finally:
        _stop(procs)
        for c in conns.values():
            c.close()
        for f in logdir.glob("*"):
            f.unlink(missing_ok=True)
        logdir.rmdir()
        del store


def _collect(
    procs: list[multiprocessing.process.BaseProcess],
    conns: dict[int, multiprocessing.connection.Connection],
    logdir: Path,
    timeout: float,
) -> list[Any]:
    world_size = len(procs)
    start = time.monotonic()
    deadline = start + timeout
    results: dict[int, Any] = {}
    failures: dict[int, RankFailure] = {}  # in the order they were seen
    pending = set(range(world_size))
    stop_at = deadline
    sentinel_rank = {procs[r].sentinel: r for r in range(world_size)}
    conn_rank = {id(conns[r]): r for r in range(world_size)}

    def log_tail(rank: int) -> str:
        return _read_tail(logdir / f"rank{rank}.log")

    while pending:
        remaining = stop_at - time.monotonic()
        if remaining <= 0:
            break
        waitables: list[Any] = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        for obj in multiprocessing.connection.wait(waitables, timeout=remaining):
            rank = conn_rank.get(id(obj), sentinel_rank.get(obj))  # type: ignore[arg-type]
            if rank is None or rank not in pending:
                continue
            conn = conns[rank]
            # A rank that reported and then exited makes both ready: read the pipe first.
            # A rank that died makes its pipe ready too, with nothing in it (EOF).
            message = None
            if conn.poll():
                with contextlib.suppress(EOFError, OSError):
                    message = conn.recv()
            elif procs[rank].is_alive():
                continue
            if message is None:
                procs[rank].join(_KILL_GRACE_S)
                reason = f"exited with code {procs[rank].exitcode} before returning a result"
                failures[rank] = RankFailure(rank, reason, "", log_tail(rank))
            elif message[0] == "ok":
                results[rank] = pickle.loads(message[1])
            else:
                failures[rank] = RankFailure(rank, "raised", message[1], log_tail(rank))
            pending.discard(rank)
        if failures:
            stop_at = min(stop_at, time.monotonic() + _FAILURE_GRACE_S)

    pids = [p.pid or -1 for p in procs]
    if not pending and not failures:
        return [results[r] for r in range(world_size)]

    hung = sorted(pending)
    for r in hung:
        if procs[r].is_alive() and procs[r].pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs[r].pid, signal.SIGUSR1)
    if hung:
        # Let faulthandler write the stacks before the logs are read.
        time.sleep(_STACK_DUMP_WAIT_S)
    elapsed = time.monotonic() - start
    hung_failures = [
        RankFailure(r, f"did not finish within {elapsed:.1f} s", "", log_tail(r)) for r in hung
    ]
    # The first failure is usually the cause; the others are peers that then lost it.
    # Except that a rank which died without a word is reported late: with forkserver its
    # sentinel fires only once the server has reaped it, while its peers' collectives
    # fail at once and they send their tracebacks ("connection closed") first. So a rank
    # that died comes before ranks that raised.
    died = [f for f in failures.values() if not f.traceback]
    raised = [f for f in failures.values() if f.traceback]
    all_failures = [*died, *raised, *hung_failures]
    details = "\n".join(f.describe() for f in all_failures)
    if failures:
        first = all_failures[0]
        summary = f"rank {first.rank} of {world_size} failed first ({first.reason})"
        if len(failures) > 1:
            summary += f"; then ranks {sorted(set(failures) - {first.rank})} failed"
        if hung:
            summary += f"; ranks {hung} did not finish (probably blocked on the failed ranks)"
        raise DistributedTestError(f"{summary}\n{details}", all_failures, pids)
    raise DistributedTestTimeout(
        f"ranks {hung} of {world_size} did not finish within {timeout:.1f} s "
        f"(deadline); their stacks follow\n{details}",
        all_failures,
        pids,
        hung,
    )
