"""A load made while serving measures batch size 1 only, serves one image per batch until
the rest is measured between batches, then takes the whole measurement; and the seconds a
load is expected to take still (the ``loading`` answer's Retry-After)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from tiny_model import tiny_model

from app.config import load_settings
from app.engine.engine import InferenceEngine, Runtime
from app.engine.load_times import FIRST_GUESS_S, OVERDUE_SHARE, LoadTimes
from app.engine.predictor import CLASSIFY, Sample
from app.engine.profiling import BackgroundProfiles

MEMORY_PROFILE_SIZES = 4  # app/engine/calibration.py
WAIT_S = 60.0  # bounds each wait for the device thread here


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[InferenceEngine]:
    engine = InferenceEngine(load_settings(device="cpu", cache=False, max_batch_size=4,
                                           target_latency_ms=10_000, profile_dir=tmp_path))
    engine.batcher.start()
    yield engine
    engine.stop()


def first_load(engine: InferenceEngine) -> Runtime:
    """tiny_model loaded as a request's load is, on the device thread."""
    return engine.batcher.call(
        lambda: engine.warm_up(tiny_model(), pinned=False, first_only=True)).result(WAIT_S)


def until(done: Callable[[], object]) -> None:
    give_up = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < give_up
        time.sleep(0.01)


def test_a_first_load_measures_one_image_and_allows_no_more(engine: InferenceEngine) -> None:
    held = threading.Event()  # the background's first step waits until the checks are done
    engine.profiling = BackgroundProfiles(engine.models, engine.batcher, engine.calibration,
                                          lambda: held.wait(WAIT_S))
    runtime = first_load(engine)
    held_up = threading.Timer(WAIT_S, held.set)
    held_up.start()
    assert not runtime.profile_complete and not engine.view().models["tiny"].profile_complete
    assert [t.batch_size for t in runtime.warmup.timings] == [1]
    assert [size for size, _ in runtime.memory.points] == [1]
    assert runtime.guard.max_batch == 1 and engine.batcher.lane("tiny").max_batch == 1
    assert runtime.guard.max_batch_now(runtime.probe.in_use()) <= 1
    assert runtime.batch_size is not None and runtime.batch_size.max_size == 1
    fit = runtime.guard.fit
    assert fit.peak(1) >= runtime.memory.points[0][1]
    assert engine.profiles.get(engine.calibration.profile_key("tiny", "tiny-1")) is None
    held.set()
    held_up.cancel()


def test_the_rest_is_measured_between_batches_then_in_force_and_stored(
        engine: InferenceEngine) -> None:
    first_load(engine)
    # Served with one image per batch while the rest is measured.
    answered = engine.batcher.submit(Sample(torch.zeros(3, 16, 16), 3, CLASSIFY), WAIT_S,
                                     lane="tiny")
    assert answered.result(WAIT_S).ranked is not None
    until(lambda: engine.runtimes["tiny"].profile_complete)
    runtime = engine.runtimes["tiny"]
    tried = [t.batch_size for t in runtime.warmup.timings]
    chosen = runtime.guard.max_batch
    assert tried == [1, 2, 4]
    sizes = [size for size, _ in runtime.memory.points]
    assert sizes == sorted({*tried[:MEMORY_PROFILE_SIZES], tried[-1], chosen})
    assert all(runtime.guard.fit.peak(size) >= peak for size, peak in runtime.memory.points)
    assert engine.batcher.lane("tiny").max_batch == chosen
    assert engine.residents["tiny"].footprint == runtime.footprint
    assert engine.view().models["tiny"].profile_complete
    stored = engine.profiles.get(engine.calibration.profile_key("tiny", "tiny-1"))
    assert stored is not None and stored.points == runtime.memory.points


def test_a_model_unloaded_meanwhile_ends_the_measurement(engine: InferenceEngine) -> None:
    steps: list[str] = []
    profiling = BackgroundProfiles(engine.models, engine.batcher, engine.calibration,
                                   lambda: steps.append("step"))
    engine.profiling = profiling
    engine.batcher.call(lambda: (engine.warm_up(tiny_model(), pinned=False, first_only=True),
                                 engine.loader.unload("tiny", "admin", False))).result(WAIT_S)
    engine.batcher.when_idle(lambda: None).result(WAIT_S)  # after the step queued first
    assert steps == [] and "tiny" not in engine.runtimes
    assert engine.profiles.get(engine.calibration.profile_key("tiny", "tiny-1")) is None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_first_load_is_expected_to_take_the_first_guess() -> None:
    clock = Clock()
    times = LoadTimes(clock)
    times.began("a", 20_000_000, True)
    clock.now += 1.5
    assert times.seconds_left("a") == pytest.approx(FIRST_GUESS_S - 1.5)


def test_a_model_loaded_before_takes_as_long_as_then() -> None:
    clock = Clock()
    times = LoadTimes(clock)
    times.began("a", 20_000_000, True)
    clock.now += 3.0
    times.ended("a", 20_000_000, True, ok=True)
    times.began("a", 20_000_000, True)
    assert times.seconds_left("a") == pytest.approx(3.0)


def test_another_model_is_expected_to_take_as_long_per_byte() -> None:
    clock = Clock()
    times = LoadTimes(clock)
    times.began("small", 10_000_000, True)
    clock.now += 2.0
    times.ended("small", 10_000_000, True, ok=True)
    times.began("large", 30_000_000, True)
    assert times.seconds_left("large") == pytest.approx(6.0)


def test_a_failed_load_teaches_nothing_and_an_overdue_one_needs_a_quarter_more() -> None:
    clock = Clock()
    times = LoadTimes(clock)
    times.began("a", 1000, True)
    clock.now += 50
    times.ended("a", 1000, True, ok=False)
    times.began("b", 1000, True)
    clock.now += FIRST_GUESS_S + 1
    assert times.seconds_left("b") == pytest.approx(max(1.0, OVERDUE_SHARE * FIRST_GUESS_S))


def test_a_load_not_begun_waits_for_those_in_progress() -> None:
    clock = Clock()
    times = LoadTimes(clock)
    times.began("a", 1000, True)
    clock.now += 1.0
    assert times.seconds_left("b") == pytest.approx(FIRST_GUESS_S - 1.0 + FIRST_GUESS_S)
