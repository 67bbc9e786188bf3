"""fsdp-plan: know before launch whether a job fits, and what it will move.

``plan(module, world_size, **fully_shard options)`` runs the real wrapping code for one
rank on the meta device over a fake process group and reads per-rank bytes off the
buffers it built; the ``fsdp-plan`` command prints them as a table.
"""

from importlib.metadata import version as _version

from fsdp_plan.plan import MODEL_STATE_KEYS, Plan, plan

__version__ = _version("fsdp-plan")

__all__ = ["MODEL_STATE_KEYS", "Plan", "__version__", "plan"]
