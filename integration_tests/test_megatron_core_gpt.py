"""A Megatron-Core client: a real ``GPTModel`` (local layer spec, CPU, 2 ranks) trained
with Megatron-Core's own ``finalize_model_grads`` and its own optimizer
(``get_megatron_optimizer``: Adam; its gradient norm compared too), once under Megatron-Core's own
``DistributedDataParallel`` (the reference) and once under each of fsdp's adapters:
``fsdp.DistributedDataParallel`` (all-reduce; Megatron-Core's ``FP32Optimizer`` reads
``main_grad``), the same with ``use_distributed_optimizer=True`` stepped by Megatron-Core's
``DistributedOptimizer`` (it reads ``model.buffers``: buckets, ``grad_data``,
``param_data``, ``param_index_map``, and gathers through ``model.bucket_groups``), and
``fsdp.FullyShardedDataParallel`` (``optim_grads_params``, Megatron-Core's
``TransformerLayer`` as the FSDP unit; Megatron-Core's ``DistributedOptimizer`` on its
Megatron-FSDP path reads ``param_and_grad_buffer``). Megatron-Core's own DDP with its
``DistributedOptimizer`` runs too. The losses and gradient norms of every step and the
final weights must equal the reference's (fp32, 1e-5).

megatron-core 0.19's wheel declares Python >= 3.12, and its sources are pure Python
that imports on 3.11, so the wheel is fetched by package name with pip (cached under
``$FSDP_TEST_CACHE``, default ``~/.cache/fsdp-tests``) and unpacked onto ``sys.path``.
The test skips, with the reason, when that cannot be done (no pip, no network and no
cache). Megatron-Core assumes CUDA in a few places; those are patched here, in the
test, never in fsdp: the current device is the CPU, the current stream is a no-op
object, the CUDA RNG tracker's fork is a no-op (dropout is 0), and the causal mask is
passed explicitly (its default is built on "cuda"), and the optimizer modules'
small tensors made on ``device="cuda"`` are made on the CPU; while its
``DistributedOptimizer`` is built, ``tensor.type()`` names CPU tensors as CUDA ones (it
sorts parameters by ``torch.cuda.FloatTensor`` and the like).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsdp_mesh.testing import run_distributed

VERSION = "0.19.2"
WORLD = 2
STEPS = 3
ROWS = 2  # per rank
SEQ = 8
VOCAB = 64
LR = 1e-2
# Megatron-Core's DDP (the reference), then with its DistributedOptimizer, fsdp's DDP
# adapter with Megatron-Core's FP32Optimizer and with its DistributedOptimizer, fsdp's FSDP.
KINDS = ("megatron", "megatron_distopt", "fsdp_ddp", "fsdp_ddp_distopt", "fsdp")


def _cache_dir() -> Path:
    root = os.environ.get("FSDP_TEST_CACHE") or Path.home() / ".cache" / "fsdp-tests"
    return Path(root) / f"megatron-core-{VERSION}"


def _pip() -> list[str] | None:
    for cmd in ([sys.executable, "-m", "pip"], [shutil.which("pip3")], [shutil.which("pip")]):
        if cmd[0] is None:
            continue
        probe = subprocess.run([*cmd, "--version"], capture_output=True, check=False)
        if probe.returncode == 0:
            return cmd
    return None


def _megatron_core_path() -> str:
    """The unpacked megatron-core wheel (fetched once), or skip with the reason."""
    target = _cache_dir()
    unpacked = target / "src"
    if (unpacked / "megatron" / "core" / "__init__.py").exists():
        return str(unpacked)
    pip = _pip()
    if pip is None:
        pytest.skip("megatron-core is not cached and no pip is available to fetch it")
    wheels = target / "wheels"
    fetched = subprocess.run(
        [*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
         f"megatron-core=={VERSION}", "-d", str(wheels)],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    found = sorted(wheels.glob("megatron_core-*.whl")) if wheels.exists() else []
    if fetched.returncode != 0 or not found:
        pytest.skip(f"cannot fetch megatron-core=={VERSION}: {fetched.stderr.strip()[-300:]}")
    partial = target / "src.partial"
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(found[0]) as wheel:
        wheel.extractall(partial)
    partial.rename(unpacked)
    return str(unpacked)


# ---- on each rank -------------------------------------------------------------------------
class _CpuFactories:
    """``torch`` as seen by a Megatron-Core module that allocates small tensors on
    ``device="cuda"``: those factories allocate on the CPU instead."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full")

    def __init__(self, torch_module: Any) -> None:
        self._torch = torch_module

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._torch, name)
        if name not in self._FACTORIES:
            return attr

        def on_cpu(*args: Any, device: Any = None, **kwargs: Any) -> Any:
            return attr(*args, device="cpu" if device == "cuda" else device, **kwargs)

        return on_cpu


def _patch_cuda_isms() -> None:
    """What Megatron-Core needs to run on CPU (see the module note)."""
    from types import SimpleNamespace

    import torch

    torch.cuda.current_device = lambda: "cpu"
    stream = SimpleNamespace(
        wait_event=lambda event: None, wait_stream=lambda other: None, synchronize=lambda: None
    )
    torch.cuda.current_stream = lambda *args, **kwargs: stream
    torch.cuda.synchronize = lambda *args, **kwargs: None  # dist_checkpointing's writer
    import megatron.core.optimizer.clip_grads
    import megatron.core.optimizer.distrib_optimizer
    import megatron.core.optimizer.optimizer
    import megatron.core.utils

    for module in (
        megatron.core.optimizer.optimizer,
        megatron.core.optimizer.distrib_optimizer,
        megatron.core.optimizer.clip_grads,
        megatron.core.utils,
    ):
        module.torch = _CpuFactories(torch)


@contextlib.contextmanager
def _cuda_type_names(torch) -> Iterator[None]:
    """While Megatron-Core's ``DistributedOptimizer`` is built: ``tensor.type()`` of a CPU
    tensor says ``torch.cuda.FloatTensor`` (it sorts parameters by those names)."""
    original = torch.Tensor.type

    def type_name(self, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_name
    try:
        yield
    finally:
        torch.Tensor.type = original


def _build(torch, parallel_state: Any, vocab: int = VOCAB) -> tuple[Any, Any]:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
    )
    torch.manual_seed(0)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=vocab,
        max_sequence_length=SEQ,
    )
    return config, model


def _batch(torch, step: int) -> tuple[Any, Any, Any, Any]:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (WORLD * ROWS, SEQ + 1), generator=g)
    mine = slice(dist.get_rank() * ROWS, (dist.get_rank() + 1) * ROWS)
    x, labels = tokens[mine, :-1], tokens[mine, 1:]
    positions = torch.arange(SEQ).expand(ROWS, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
    return x, positions, mask, labels


def _train(kind: str) -> tuple[list[float], dict[str, Any]]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel as MegatronDDP
    from megatron.core.distributed import DistributedDataParallelConfig as MegatronDDPConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    import fsdp

    config, module = _build(torch, parallel_state)
    distopt = kind.endswith("_distopt")  # Megatron-Core's DistributedOptimizer over a DDP
    if kind in ("megatron", "megatron_distopt"):
        model = MegatronDDP(
            config,
            MegatronDDPConfig(overlap_grad_reduce=False, use_distributed_optimizer=distopt),
            module,
        )
    elif kind in ("fsdp_ddp", "fsdp_ddp_distopt"):
        model = fsdp.DistributedDataParallel(
            config,
            MegatronDDPConfig(
                overlap_grad_reduce=True, bucket_size=4000, use_distributed_optimizer=distopt
            ),
            module,
        )
        assert isinstance(model.buffers, list) and model.buffers[0].params
    else:
        ddp_config = MegatronDDPConfig(
            use_megatron_fsdp=True,
            use_distributed_optimizer=True,
            data_parallel_sharding_strategy="optim_grads_params",
        )
        model = fsdp.FullyShardedDataParallel(config, ddp_config, module)
        assert len(model.module.hooks.units) == config.num_layers  # TransformerLayer units
    sharded = kind == "fsdp" or distopt
    # Megatron-Core's optimizer: FP32Optimizer over main_grad for the all-reduce DDPs, its
    # DistributedOptimizer for the others (its Megatron-FSDP path for FSDP); Adam.
    with _cuda_type_names(torch) if distopt else contextlib.nullcontext():
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=LR, weight_decay=0.0, clip_grad=0.0,
                use_distributed_optimizer=sharded,
            ),
            [model],
        )  # fmt: skip
    if kind == "fsdp_ddp_distopt":  # it reads fsdp's buffers through Megatron-Core's view
        inner = getattr(optimizer, "chained_optimizers", [optimizer])
        assert [type(o).__name__ for o in inner] == ["DistributedOptimizer"], inner
        assert len(inner[0].gbuf_ranges) == len(model.buffers)
    losses, norms = [], []
    for step in range(STEPS):
        model.zero_grad_buffer()  # as Megatron-LM's train_step does, then
        optimizer.zero_grad()
        x, positions, mask, labels = _batch(torch, step)
        loss = model(x, positions, mask, labels=labels).mean()
        loss.backward()
        finalize_model_grads([model])  # Megatron-Core's own
        # Its clipping asserts CUDA tensors (so clip_grad=0); the gradient norm it would
        # clip by is compared: FP32Optimizer reports it from step() (it reads main_grad
        # there), DistributedOptimizer reports 0 without clipping, so ask it before.
        if distopt:  # its shards' .grad are set from main_grad by prepare_grads()
            optimizer.prepare_grads()
        before = optimizer.get_grad_norm() if sharded else None
        updated, grad_norm, _ = optimizer.step()
        grad_norm = before if sharded else grad_norm
        assert updated and grad_norm > 0, (kind, step, grad_norm)
        norms.append(float(grad_norm))
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
    if kind == "fsdp":
        weights = model.module.buffer.views.full_parameters()
    else:
        weights = {n: p.detach().clone() for n, p in module.named_parameters()}
    return losses + norms, weights


def _setup(path: str) -> None:
    sys.path.insert(0, path)
    import warnings

    warnings.filterwarnings("ignore")  # Apex/TE absent, GPTModel deprecation notices
    _patch_cuda_isms()
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def _rank(path: str) -> dict[str, Any]:
    _setup(path)
    return {kind: _train(kind) for kind in KINDS}


def _checkpoint_rank(path: str, directory: str) -> dict[str, Any]:
    """Save the FSDP-wrapped model with Megatron-Core's dist_checkpointing (torch_dist),
    perturb it, load it back; then load the same checkpoint into an unwrapped GPTModel."""
    _setup(path)
    import torch
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig as MegatronDDPConfig

    import fsdp

    vocab = 65  # odd rows: the embedding's and output layer's torch.chunk pieces are uneven
    config, module = _build(torch, parallel_state, vocab)
    ddp_config = MegatronDDPConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params"
    )
    model = fsdp.FullyShardedDataParallel(config, ddp_config, module)
    saved = model.module.buffer.views.full_parameters()
    pieces = {k: v.to_local().shape for k, v in model.state_dict().items() if k in saved}
    # Its writer collects results through a multiprocessing Manager (a child process),
    # which a daemonic rank process may not start: this rank is not daemonic for it.
    import multiprocessing

    multiprocessing.current_process().daemon = False
    # It logs its memory use through psutil, a dependency of the wheel not installed here.
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._process_memory = lambda: 0
    Path(directory).mkdir(parents=True, exist_ok=True)  # Megatron-Core saves into it
    dist_checkpointing.save(model.sharded_state_dict(), directory)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(1.0)
    perturbed = model.module.buffer.views.full_parameters()
    loaded = dist_checkpointing.load(model.sharded_state_dict(), directory)
    model.load_state_dict(loaded)
    restored = model.module.buffer.views.full_parameters()
    # Megatron-Core's own model reads the same checkpoint.
    _, plain = _build(torch, parallel_state, vocab)
    with torch.no_grad():
        for p in plain.parameters():
            p.zero_()
    plain.load_state_dict(dist_checkpointing.load(plain.sharded_state_dict(), directory))
    unwrapped = {n: p.detach().clone() for n, p in plain.named_parameters()}
    return {
        "saved": saved,
        "perturbed": perturbed,
        "restored": restored,
        "unwrapped": unwrapped,
        "pieces": pieces,
    }


def test_megatron_core_gpt_trains_like_megatron_core_ddp(monkeypatch):
    path = _megatron_core_path()
    monkeypatch.syspath_prepend(path)  # the results unpickle Megatron-Core's types
    import torch

    for out in run_distributed(_rank, WORLD, args=(path,), timeout=300):
        ref_losses, ref_weights = out["megatron"]  # losses, then gradient norms
        for kind in KINDS[1:]:
            losses, weights = out[kind]
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6
            )
            assert weights.keys() == ref_weights.keys(), kind
            for name, value in ref_weights.items():
                torch.testing.assert_close(
                    weights[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
                )


def test_megatron_dist_checkpointing_round_trips_fsdp_weights(monkeypatch, tmp_path):
    """``FullyShardedDataParallel.sharded_state_dict()`` under Megatron-Core's
    ``dist_checkpointing.save`` / ``load`` (torch_dist backend, as Megatron-LM's
    ``--ckpt-format torch_dist``): the weights come back exactly after being perturbed, the
    pieces saved are uneven ``torch.chunk`` pieces, and the checkpoint is Megatron-Core's
    layout: an unwrapped ``GPTModel`` loads the same weights from it."""
    path = _megatron_core_path()
    monkeypatch.syspath_prepend(path)
    import torch

    directory = str(tmp_path / "ckpt")
    outs = run_distributed(_checkpoint_rank, WORLD, args=(path, directory), timeout=240)
    rows = [out["pieces"]["embedding.word_embeddings.weight"][0] for out in outs]
    assert rows == [33, 32], rows  # uneven pieces of the 65-row embedding
    for out in outs:
        saved = out["saved"]
        assert saved.keys() == out["unwrapped"].keys()
        for name, value in saved.items():
            assert not torch.equal(out["perturbed"][name], value), name
            torch.testing.assert_close(out["restored"][name], value, rtol=0, atol=0)
            torch.testing.assert_close(out["unwrapped"][name], value, rtol=0, atol=0)
