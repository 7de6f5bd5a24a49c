"""Issue 27, item 8: the engine's clock jumps by a night, as after a laptop's sleep (the
monotonic clock counts the sleep on Windows). The ticks after the jump give the cache
back once and suspect no leak, the model kept loaded stays, and the next batch is
served; the load limit, full before the sleep, lets a load through after it. The whole
server stopped for a minute, for real: live/test_sleep_resume.py."""

from __future__ import annotations

from concurrent.futures import wait

import pytest
from tiny_model import tiny_model

from app.config import load_settings
from app.engine.engine import InferenceEngine, Phase
from app.engine.residency import LoadRate
from app.errors import Overloaded

NIGHT_S = 8 * 3600.0


def test_a_night_long_jump_of_the_clock_is_one_quiet_spell():
    now = [1000.0]
    settings = load_settings(device="cpu", max_batch_size=2, cache=False, idle_release_s=5)
    engine = InferenceEngine(settings, clock=lambda: now[0])
    runtime = engine.warm_up(tiny_model())
    engine.phase = Phase.READY
    engine.batcher.start()
    try:
        sample = runtime.predictor.random_batch(1)[0]

        def serve_one() -> None:
            future = engine.batcher.submit(sample, timeout_s=30)
            wait([future], timeout=30)
            assert future.exception() is None

        serve_one()
        engine.upkeep.touch()
        engine.tick()
        before = runtime.guard.counters.idle_releases
        now[0] += NIGHT_S
        for _ in range(3):
            engine.tick()
            now[0] += 1
        view = engine.view()
        assert view.ready and view.memory is not None
        assert not view.memory.leak_suspected
        assert runtime.guard.counters.idle_releases == before + 1  # once, not per second
        assert "tiny" in engine.models.runtimes  # kept loaded: no keep-alive runs out
        serve_one()
    finally:
        engine.stop()


def test_the_load_limit_full_before_a_sleep_is_free_after_it():
    now = [0.0]
    rate = LoadRate(2, clock=lambda: now[0])
    rate.take()
    rate.take()
    with pytest.raises(Overloaded):
        rate.take()
    now[0] += NIGHT_S
    rate.take()
    rate.take()
