"""The engine's warmup on the CPU with a small real model: what it times, what memory it
measures, and how an out-of-memory at a large batch size caps the size instead of failing
the start."""

from __future__ import annotations

import time

import pytest
import torch
from cuda_messages import CUDNN_DEVICE_ALLOCATION_FAILED, cudnn_error
from tiny_model import tiny_model

from app.config import load_settings
from app.engine.engine import InferenceEngine, Runtime
from app.engine.predictor import Predictor

SLOW_BUILD_S = 0.2


def warm(**settings: object) -> tuple[InferenceEngine, Runtime]:
    engine = InferenceEngine(load_settings(device="cpu", cache=False, **settings))
    return engine, engine.warm_up(tiny_model())


def test_warmup_does_not_time_building_its_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow input builder (randn on one CPU thread costs more than a GPU's forward pass)
    must not count: only the batch call serving pays is timed."""
    build = Predictor.random_batch

    def slow_build(self: Predictor, size: int) -> object:
        time.sleep(SLOW_BUILD_S)
        return build(self, size)

    monkeypatch.setattr(Predictor, "random_batch", slow_build)
    _, runtime = warm(max_batch_size=4, target_latency_ms=1000)
    seconds = [t.seconds for t in runtime.warmup.timings]
    assert [t.batch_size for t in runtime.warmup.timings] == [1, 2, 4]
    assert max(seconds) < SLOW_BUILD_S, seconds


def test_memory_is_measured_at_the_chosen_and_the_largest_size() -> None:
    engine, runtime = warm(max_batch_size=16, target_latency_ms=10_000)
    sizes = [size for size, _ in runtime.memory.points]
    assert 16 in sizes and engine.batcher.max_batch in sizes
    assert {1, 2, 4, 8} <= set(sizes)
    fit = runtime.memory.fit
    assert all(fit.peak(size) >= peak for size, peak in runtime.memory.points)


def test_a_batch_size_set_by_the_user_is_measured_too() -> None:
    _, runtime = warm(max_batch_size=2, batch_size=6, target_latency_ms=10_000)
    assert 6 in [size for size, _ in runtime.memory.points]


def test_cudnn_benchmark_is_set_explicitly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    warm(max_batch_size=1)
    assert torch.backends.cudnn.benchmark is False


def _fails_above(limit: int, error: BaseException, monkeypatch: pytest.MonkeyPatch) -> None:
    forward = Predictor.__call__

    def scripted(self: Predictor, samples: list[object]) -> object:
        if len(samples) > limit:
            raise error
        return forward(self, samples)  # type: ignore[arg-type]

    monkeypatch.setattr(Predictor, "__call__", scripted)


def test_an_oom_at_a_large_size_caps_the_batch_instead_of_failing_the_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _fails_above(2, torch.AcceleratorError("CUDA error: out of memory"), monkeypatch)
    engine, runtime = warm(max_batch_size=16, target_latency_ms=10_000)
    assert [t.batch_size for t in runtime.warmup.timings] == [1, 2]
    assert engine.batcher.max_batch <= 2 and runtime.guard.max_batch <= 2
    assert all(size <= 2 for size, _ in runtime.memory.points)


def test_an_oom_at_the_pinned_size_caps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _fails_above(4, cudnn_error(CUDNN_DEVICE_ALLOCATION_FAILED), monkeypatch)
    engine, runtime = warm(max_batch_size=4, batch_size=8, target_latency_ms=10_000)
    assert engine.batcher.max_batch == 4
    assert max(size for size, _ in runtime.memory.points) == 4


def test_an_oom_at_batch_one_fails_the_start_and_says_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _fails_above(0, torch.OutOfMemoryError("CUDA out of memory"), monkeypatch)
    with pytest.raises(RuntimeError, match="not enough memory"):
        warm(max_batch_size=4)


def test_a_reused_profile_that_no_longer_fits_its_batch_warms_up_with_one_image(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reused profile's warm pass runs at the chosen batch; measured with more room
    than there is now, that pass runs out of memory: the load still succeeds."""
    warm(max_batch_size=4, batch_size=4, profile_dir=tmp_path)  # measures and stores
    _fails_above(1, torch.OutOfMemoryError("CUDA out of memory"), monkeypatch)
    _, runtime = warm(max_batch_size=4, batch_size=4, profile_dir=tmp_path)
    assert runtime.reused_profile
