"""One rank of a world of any size, with no peers: torch's fake process group.

The fake backend (``torch.testing._internal.distributed.fake_pg``, C++ in torch)
completes every collective at once without moving data, so the real wrapping code
(``DeviceMesh``, ``FSDPDistributedIndex``, ``ParamAndGradBuffer``) runs for rank
``rank`` of ``world_size`` in this process (meshes are built on it with
``fsdp_mesh.build_device_mesh``). The default process group is global, so a
process that already has one cannot host a fake world: that is refused, never reused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

__all__ = ["fake_world"]


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as rank ``rank`` of a fake world of ``world_size`` ranks (the default
    process group); torn down on exit."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}); got {rank}")
    if dist.is_initialized():
        raise RuntimeError(
            "fsdp.plan runs the wrapping code on a fake process group, and this process "
            "already has a default process group (torch.distributed is initialized); call "
            "plan() before init_process_group, or in a separate process"
        )
    # Importing the module registers the "fake" backend. Its FakeStore is a Python class
    # on torch 2.11 and torch's C++ one, re-exported there, on newer torch.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
