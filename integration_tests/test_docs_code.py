"""Every ```python block of the README and of docs/guide/*.md runs, so the documentation
cannot drift from the API.

A block runs on CPU ranks started by ``fsdp_mesh.testing.run_distributed``, as a script
under ``torchrun`` would: its own ``dist.init_process_group(...)`` makes the process
group (gloo, whatever backend it names). The working directory is a fresh temporary
directory shared by the ranks (relative paths a block writes, such as a checkpoint
directory, land there).

An HTML comment on the line before a block says how to run it:

    <!-- docs-test: world=2 -->        on 2 ranks (default: 1)
    <!-- docs-test: continue -->       after the page's previous block, in its namespace
                                       (the two run as one program, at the first's world)
    <!-- docs-test: skip: REASON -->   not run; the reason is required

A block without a comment runs alone on one rank.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from fsdp_mesh.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
MARKER = re.compile(r"^<!--\s*docs-test:\s*(?P<spec>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")
RUN_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Program:
    """One or more consecutive blocks of a page that run together."""

    page: Path
    line: int  # where its first block starts (1-based, the fence)
    code: str
    world: int
    skip: str | None  # the stated reason, when skipped

    @property
    def name(self) -> str:
        return f"{_shown(self.page)}:{self.line}"


def _shown(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def _parse_marker(spec: str, where: str) -> tuple[int, bool, str | None]:
    """(world, continue, skip reason) from a marker's text."""
    if spec.startswith("skip"):
        reason = spec.removeprefix("skip").lstrip(":").strip()
        if not reason:
            raise ValueError(f"{where}: 'docs-test: skip' needs a reason after 'skip:'")
        return 1, False, reason
    world, cont = 1, False
    for word in spec.split():
        if word == "continue":
            cont = True
        elif word.startswith("world="):
            world = int(word.removeprefix("world="))
            if world not in (1, 2):
                raise ValueError(f"{where}: world must be 1 or 2; got {world}")
        else:
            raise ValueError(
                f"{where}: unknown docs-test word {word!r}; allowed: world=N, continue, "
                f"skip: REASON"
            )
    return world, cont, None


def programs(page: Path) -> list[Program]:
    """The page's python blocks, grouped into the programs they run as."""
    lines = page.read_text().splitlines()
    found: list[Program] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        start, indent = i, len(fence["indent"])
        i += 1
        body = []
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i][indent:])
            i += 1
        i += 1  # the closing fence
        if fence["lang"] != "python":
            continue
        where = f"{_shown(page)}:{start + 1}"
        marker = MARKER.match(lines[start - 1].strip()) if start > 0 else None
        world, cont, skip = _parse_marker(marker["spec"], where) if marker else (1, False, None)
        code = "\n".join(body) + "\n"
        if cont:
            if not found or found[-1].skip is not None:
                raise ValueError(f"{where}: 'continue' needs a run block before it on the page")
            prev = found.pop()
            # Blank lines keep the traceback's line numbers pointing into this block.
            gap = "\n" * (start + 1 - prev.line - prev.code.count("\n"))
            code = prev.code + gap + code
            found.append(Program(page, prev.line, code, prev.world, None))
        else:
            found.append(Program(page, start + 1, code, world, skip))
    return found


ALL = [p for page in PAGES for p in programs(page)]


def _run_program(code: str, filename: str, line: int, workdir: str) -> None:
    import torch.distributed as dist

    os.chdir(workdir)
    rank, world = dist.get_rank(), dist.get_world_size()
    # The block starts without a process group, as a script under torchrun does (so
    # that, e.g., fsdp.plan before init_process_group works); its own
    # init_process_group joins the ranks through the harness's store, with gloo (a
    # call with its own store or init_method, such as fsdp.plan's fake group, is
    # passed through).
    dist.barrier()  # every rank is done connecting before any closes its connections
    dist.destroy_process_group()
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False
    )
    init = dist.init_process_group

    def init_process_group(backend: str | None = None, *args: object, **kwargs: object) -> None:
        if args or "store" in kwargs or "init_method" in kwargs:
            return init(backend, *args, **kwargs)  # not the env:// rendezvous (fsdp.plan's)
        init("gloo", store=dist.PrefixStore("docs/", store), rank=rank, world_size=world)

    dist.init_process_group = init_process_group
    # Line numbers in a traceback are the page's: the code starts after its fence.
    compiled = compile("\n" * line + code, filename, "exec")
    exec(compiled, {"__name__": "__main__"})


@pytest.mark.parametrize("program", ALL, ids=[p.name for p in ALL])
def test_code_block_runs(program: Program, tmp_path: Path) -> None:
    if program.skip is not None:
        pytest.skip(f"{program.name}: {program.skip}")
    run_distributed(
        _run_program,
        program.world,
        args=(program.code, str(program.page), program.line, str(tmp_path)),
        timeout=RUN_TIMEOUT_S,
        device_type="cpu",
    )


def test_readme_quickstarts_run_for_every_entry_point() -> None:
    """The extraction finds the README's quickstarts, and those that run cover every
    entry point (the Hugging Face one runs in its guide)."""
    run = "".join(p.code for p in ALL if p.page.name == "README.md" and p.skip is None)
    for call in (
        "fully_shard(",
        "fully_shard_model(",
        "MegatronFSDP(",
        "FullyShardedDataParallel(",
        "DistributedDataParallel(",
    ):
        assert call in run, f"no README block that runs calls {call}"
    guide = "".join(p.code for p in ALL if p.page.name == "hugging-face.md" and p.skip is None)
    assert "from_pretrained(" in guide


def test_markers_are_checked(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- docs-test: world=2 -->\n```python\nx = 1\n```\n\n"
        "<!-- docs-test: continue -->\n```python\ny = x\n```\n"
        "```bash\nnot python\n```\n<!-- docs-test: skip: needs a GPU -->\n```python\nz\n```\n"
    )
    first, skipped = programs(page)
    assert (first.world, first.skip, skipped.skip) == (2, None, "needs a GPU")
    lines = first.code.splitlines()
    # The second block's line sits where the page has it (line 8), for tracebacks.
    assert (lines[0], len(lines), lines[-1]) == ("x = 1", 8 - first.line, "y = x")
    for bad, message in [
        ("<!-- docs-test: skip -->", "needs a reason"),
        ("<!-- docs-test: world=3 -->", "world must be 1 or 2"),
        ("<!-- docs-test: wrld=2 -->", "unknown docs-test word"),
        ("<!-- docs-test: continue -->", "needs a run block before it"),
    ]:
        page.write_text(f"{bad}\n```python\nx = 1\n```\n")
        with pytest.raises(ValueError, match=message):
            programs(page)
