"""Bad input raises a clear error on every rank, never a hang (each check runs inside
every rank, under the harness's deadline)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_hooks import fully_shard, fully_shard_model
from fsdp_mesh.testing import run_distributed
from fsdp_mesh.testing.models import GPT, Block, GPTConfig

CFG = GPTConfig(vocab_size=32, max_seq_len=8, dim=16, n_heads=2, n_layers=2)


def _gpt(cfg=CFG):
    torch.manual_seed(0)
    return GPT(cfg)


def _sgd(module):
    return torch.optim.SGD(module.parameters(), lr=0.1)


def _body():
    rank = dist.get_rank()

    # Wrapping an already-wrapped model, or a module inside one, or its inner module.
    model = fully_shard_model(_gpt(), fsdp_unit_modules=[Block])
    with pytest.raises(ValueError, match="already wrapped by fsdp"):
        fully_shard_model(model)
    with pytest.raises(ValueError, match="already wrapped by fsdp"):
        fully_shard_model(nn.Sequential(model))
    with pytest.raises(ValueError, match="already belong to an fsdp-wrapped model"):
        fully_shard_model(model.module)
    with pytest.raises(ValueError, match="already belong to an fsdp-wrapped model"):
        fully_shard_model(model.module.blocks[0])

    # A unit class or dotted path that matches no module lists the types present.
    with pytest.raises(ValueError, match=r"matches no submodule.*module types present") as e:
        fully_shard_model(_gpt(), fsdp_unit_modules=[nn.Conv2d])
    assert "fsdp_mesh.testing.models.Block" in str(e.value)
    assert "torch.nn.modules.sparse.Embedding" in str(e.value)
    with pytest.raises(ValueError, match=r"torch\.nn\.modules\.conv\.Conv1d matches no") as e:
        fully_shard_model(_gpt(), fsdp_unit_modules=[Block, "torch.nn.Conv1d"])
    assert "fsdp_mesh.testing.models.Block" in str(e.value)
    with pytest.raises(ValueError, match=r"cannot import FSDP unit class 'no_such_pkg\.Block'"):
        fully_shard_model(_gpt(), fsdp_unit_modules=["no_such_pkg.Block"])
    with pytest.raises(ValueError, match="must be a dotted path"):
        fully_shard_model(_gpt(), fsdp_unit_modules=["Block"])

    # An optimizer over parameters that are not the module's.
    module, other = _gpt(), nn.Linear(3, 5)
    with pytest.raises(ValueError, match=r"1 parameter\(s\) that are not the wrapped module's"):
        fully_shard(module, torch.optim.SGD([*module.parameters(), other.weight], lr=0.1))
    with pytest.raises(ValueError, match="not the wrapped module's"):
        fully_shard(_gpt(), _sgd(other))

    # A model that differs across ranks: the fingerprint check raises, no hang.
    cfg = CFG if rank == 0 else GPTConfig(**{**CFG.__dict__, "dim": 24})
    with pytest.raises(ValueError, match="the model differs across data-parallel ranks") as e:
        fully_shard_model(_gpt(cfg))
    assert "rank 1 differs from rank 0" in str(e.value)
    # The first parameter that differs, with both shapes.
    assert "('tok.weight', (32, 16)" in str(e.value) and "(32, 24)" in str(e.value)
    # The same shapes but a parameter frozen on one rank only.
    module = _gpt()
    if rank == 1:
        module.ln_f.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"rank 1 differs from rank 0: .*ln_f\.weight"):
        fully_shard_model(module)

    # An unknown strategy name (or number).
    for bad in ("zero4", "full_shard", 4):
        with pytest.raises(ValueError, match=r"Invalid sharding strategy.*'optim_grads_params'"):
            fully_shard_model(_gpt(), zero_dp_strategy=bad)

    # (Meta parameters without init_model_with_meta_device are FSDP2's route, accepted:
    # test_meta_init_weights.)

    # Arguments of the wrong kind: a TypeError saying what is allowed, before anything
    # is touched (was: a string iterated by character, raw AttributeError/TypeError).
    units = "fsdp_unit_modules must be a list of nn.Module subclasses or dotted class paths"
    with pytest.raises(TypeError, match=rf"{units}.*the class Block itself: pass \[Block\]"):
        fully_shard_model(_gpt(), fsdp_unit_modules=Block)
    with pytest.raises(TypeError, match=rf"{units}.*letter by letter: pass \['mod.Block'\]"):
        fully_shard_model(_gpt(), fsdp_unit_modules="mod.Block")
    with pytest.raises(TypeError, match=rf"{units}.*got dict"):
        fully_shard_model(_gpt(), fsdp_unit_modules={Block: 1})
    with pytest.raises(TypeError, match=rf"{units}.*got the class Block"):
        fully_shard(_gpt(), _sgd(_gpt()), fsdp_unit_modules=Block)
    with pytest.raises(TypeError, match=r"device_mesh must be a torch\..*DeviceMesh.*got str"):
        fully_shard_model(_gpt(), device_mesh="x")
    with pytest.raises(TypeError, match=r"mixed_precision_policy must be a .*MixedPrecisionPolicy"):
        fully_shard_model(_gpt(), mixed_precision_policy="bf16")
    with pytest.raises(TypeError, match=r"module to shard must be a torch\.nn\.Module; got str"):
        fully_shard_model("model")
    with pytest.raises(TypeError, match=r"module to shard must be a torch\.nn\.Module; got str"):
        fully_shard("model", _sgd(_gpt()))
    module = _gpt()
    with pytest.raises(
        TypeError, match=r"optimizer must be a torch.optim.Optimizer.*fully_shard_model"
    ):
        fully_shard(module, None)
    assert all(type(p) is nn.Parameter for p in module.parameters())  # left as it was

    # After all that, a good model still wraps and runs on every rank.
    module = _gpt()
    model, opt = fully_shard(module, _sgd(module), fsdp_unit_modules=[Block])
    x = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len))
    model(x).sum().backward()
    opt.step()
    return True


def test_bad_input_raises_clearly_on_every_rank():
    assert run_distributed(_body, 2, timeout=60) == [True, True]
