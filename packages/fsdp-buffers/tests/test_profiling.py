import threading

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from fsdp_buffers import profiling
from fsdp_buffers.profiling import annotate


def _labels(prof) -> list[str]:
    return [evt.key for evt in prof.key_averages()]


def test_context_manager_shows_in_a_torch_profiler_trace():
    with profile(activities=[ProfilerActivity.CPU]) as prof, annotate("fsdp.test.label"):
        torch.ones(4).add_(1)
    assert "fsdp.test.label" in _labels(prof)
    [avg] = [e for e in prof.key_averages() if e.key == "fsdp.test.label"]
    assert avg.count == 1


def test_decorator_opens_one_range_per_call():
    @annotate("fsdp.test.decorated")
    def step(x):
        """Docstring kept."""
        return x + 1

    assert step.__name__ == "step"
    assert step.__doc__ == "Docstring kept."
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert step(1) == 2
        assert step(2) == 3
    [avg] = [e for e in prof.key_averages() if e.key == "fsdp.test.decorated"]
    assert avg.count == 2


def test_recursion_under_the_decorator():
    @annotate("fsdp.test.recursive")
    def depth(n):
        return 0 if n == 0 else 1 + depth(n - 1)

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert depth(3) == 3
        with annotate("fsdp.test.after_recursion"):
            pass
    # torch.profiler folds directly nested ranges of one name into one event, so only
    # presence is checked; a later range still closes cleanly.
    labels = _labels(prof)
    assert "fsdp.test.recursive" in labels
    assert "fsdp.test.after_recursion" in labels


def test_no_range_without_profiler_and_no_error():
    with annotate("fsdp.test.idle") as cm:
        assert isinstance(cm, annotate)
        assert cm.open_ranges == 0
    assert cm.open_ranges == 0


def test_range_is_closed_when_the_body_raises():
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with pytest.raises(RuntimeError, match="boom"), annotate("fsdp.test.raises"):
            raise RuntimeError("boom")
        with annotate("fsdp.test.after"):
            pass
    labels = _labels(prof)
    assert "fsdp.test.raises" in labels
    assert "fsdp.test.after" in labels


def test_reentering_one_object_while_open():
    cm = annotate("fsdp.test.reentered")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with cm:
            with cm:
                assert cm.open_ranges == 2
            assert cm.open_ranges == 1
        assert cm.open_ranges == 0
        with cm:
            pass
    [avg] = [e for e in prof.key_averages() if e.key == "fsdp.test.reentered"]
    assert avg.count == 2  # the nested pair folds into one event, plus the second use


def test_one_object_entered_before_and_while_profiling():
    """Enters with and without a profiler nest in one object: only the one made while
    profiling opens (and its own exit closes) a range."""
    cm = annotate("fsdp.test.mixed")
    with cm:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with cm:
                assert cm.open_ranges == 1
                with cm:
                    assert cm.open_ranges == 2
                assert cm.open_ranges == 1
            assert cm.open_ranges == 0
        assert cm.open_ranges == 0
    [avg] = [e for e in prof.key_averages() if e.key == "fsdp.test.mixed"]
    assert avg.count == 1  # the nested pair folds into one event


class FakeDomain:
    """Stands in for an nvtx.Domain with a tool attached; records push/pop per thread."""

    def __init__(self):
        self.events = []
        self.lock = threading.Lock()

    def get_event_attributes(self, message):
        return ("attrs", message)

    def push_range(self, attrs):
        with self.lock:
            self.events.append(("push", attrs[1]))

    def pop_range(self):
        with self.lock:
            self.events.append(("pop",))


def test_nvtx_range_pushed_and_popped_when_a_tool_is_attached(monkeypatch):
    domain = FakeDomain()
    monkeypatch.setattr(profiling, "_nvtx_domain", domain)
    monkeypatch.setattr(profiling, "_nvtx_attributes", {})
    with pytest.raises(ValueError), annotate("fsdp.test.outer"):
        with annotate("fsdp.test.inner"):
            pass
        raise ValueError
    assert domain.events == [
        ("push", "fsdp.test.outer"),
        ("push", "fsdp.test.inner"),
        ("pop",),
        ("pop",),
    ]
    # Attributes are built once per label.
    assert set(profiling._nvtx_attributes) == {"fsdp.test.outer", "fsdp.test.inner"}


def test_nvtx_domain_is_fsdp():
    assert profiling.NVTX_DOMAIN == "fsdp"


@pytest.mark.parametrize(("label", "error"), [(None, TypeError), (3, TypeError), ("", ValueError)])
def test_bad_labels(label, error):
    with pytest.raises(error, match="label"):
        annotate(label)


@pytest.mark.cuda  # runs under --fsdp-device cuda (scripts/gpu-check)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shows_in_a_cuda_trace():
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with annotate("fsdp.test.cuda"):
            torch.ones(4, device="cuda").add_(1)
        torch.cuda.synchronize()
    assert "fsdp.test.cuda" in _labels(prof)


def test_profiler_starting_or_stopping_inside_an_open_range():
    outer = annotate("fsdp.test.open_before_start")
    outer.__enter__()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outer.__exit__(None, None, None)  # opened with no profiler: nothing to close
        inner = annotate("fsdp.test.open_before_stop")
        inner.__enter__()
    inner.__exit__(None, None, None)  # profiler already stopped
    assert "fsdp.test.open_before_start" not in _labels(prof)


def _profiled_standalone_step():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "standalone_loop.py"
    spec = importlib.util.spec_from_file_location("standalone_loop_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        example.train(3, steps=1, per_rank_batch=2)
    return sorted({label for label in _labels(prof) if label.startswith("fsdp.")})


def test_real_gathers_releases_and_reductions_are_labelled():
    """A ZeRO-3 step of the standalone loop (fsdp-buffers alone) on 2 ranks: every
    gather, release, reduction and wait shows as a range, named by its bucket."""
    from fsdp_mesh.testing import run_distributed

    for labels in run_distributed(_profiled_standalone_step, 2):
        for prefix in ("fsdp.all_gather.", "fsdp.release.", "fsdp.reduce.", "fsdp.wait"):
            assert any(label.startswith(prefix) for label in labels), (prefix, labels)
        assert "fsdp.install_optimized_model_weights" in labels, labels
