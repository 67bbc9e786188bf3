"""fsdp: Fully Sharded Data Parallel for PyTorch, one import for every layer.

Re-exports the public API of ``fsdp_mesh`` (who talks to whom), ``fsdp_buffers``
(where the bytes live and how they move), ``fsdp_hooks`` (when the bytes move:
``fully_shard`` and the Megatron-Core style adapters), ``fsdp_ckpt`` (checkpoints) and
``fsdp_plan`` (``fsdp.plan``: per-rank bytes before launch).
``fsdp.versions()`` (or ``python -m fsdp``) tells the version of each layer. The demo
command ``fsdp-demo`` lives in ``fsdp.demo``.
"""

from importlib.metadata import version as _version

from fsdp._versions import versions
from fsdp_buffers import *  # noqa: F403
from fsdp_buffers import __all__ as _buffers_all
from fsdp_ckpt import *  # noqa: F403
from fsdp_ckpt import __all__ as _ckpt_all
from fsdp_hooks import *  # noqa: F403
from fsdp_hooks import __all__ as _hooks_all
from fsdp_mesh import *  # noqa: F403
from fsdp_mesh import __all__ as _mesh_all
from fsdp_plan import *  # noqa: F403
from fsdp_plan import __all__ as _plan_all

__version__ = _version("fsdp")

__all__ = [  # the layers' own lists, so that this one never goes stale
    *sorted({*_mesh_all, *_buffers_all, *_hooks_all, *_ckpt_all, *_plan_all} - {"__version__"}),
    "__version__",
    "versions",
]
