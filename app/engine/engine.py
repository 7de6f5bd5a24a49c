"""The inference engine: one model, one device thread, one batcher, one memory guard.

It loads the model and runs warmup on the device thread (so that thread is
the only one that ever touches the GPU), measures what a batch costs in
memory, then serves ``classify`` calls from the event loop, which only awaits
futures. Every forward pass goes through the OOM recovery; every batch is
sized by the guard.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass

from app.config import Settings
from app.engine.batcher import MicroBatcher
from app.engine.device import resolve_device
from app.engine.oom import OomRecovery, Outcome
from app.engine.predictor import Prediction, Predictor, Sample
from app.engine.warmup import WarmupProfile, batch_sizes, profile
from app.errors import NotReady, Paused
from app.memory.budget import Budget
from app.memory.fit import MemoryFit, fit_linear
from app.memory.guard import GuardState, MemoryGuard
from app.memory.probes import MemoryReading, Probe, make_probe
from app.models import LoadedModel, load_model

log = logging.getLogger("vramguard.engine")
GPU_DEFAULT_WAIT_S = 0.002
MEMORY_PROFILE_SIZES = 4  # batch sizes 1, 2, 4, 8 (as far as warmup went)


class Phase(enum.StrEnum):
    STARTING = "starting"
    LOADING = "loading"
    WARMING_UP = "warming_up"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True)
class MemoryProfile:
    """What warmup measured about memory."""

    weights_bytes: int
    overhead_bytes: int
    others_at_start: int
    fit: MemoryFit
    points: list[tuple[int, int]]


def weights_bytes(model: LoadedModel) -> int:
    module = model.module
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


class InferenceEngine:
    """Owns the model, the batcher and the guard; ``start`` must finish before ``classify``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.phase = Phase.STARTING
        self.error: str | None = None
        self.model: LoadedModel | None = None
        self.predictor: Predictor | None = None
        self.warmup: WarmupProfile | None = None
        self.memory: MemoryProfile | None = None
        self.probe: Probe | None = None
        self.guard: MemoryGuard | None = None
        self._recovery: OomRecovery | None = None
        self._peak_since_tick = 0
        self._last_activity = time.monotonic()
        self._released = True
        self.paused = False
        self.last_report: dict[str, object] = {}
        wait_s = settings.max_wait_ms / 1000 if settings.max_wait_ms is not None else (
            GPU_DEFAULT_WAIT_S if self.device.type == "cuda" else 0.0)
        self.batcher: MicroBatcher[Sample, Outcome] = MicroBatcher(
            self._run_batch, max_batch=1, max_wait_s=wait_s, queue_size=settings.queue_size,
            batch_limit=self._batch_limit)

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    async def start(self) -> None:
        """Load the model and run warmup on the device thread; record any failure."""
        self.batcher.start()
        try:
            self.phase = Phase.LOADING
            self.model = await asyncio.wrap_future(self.batcher.call(self.load))
            self.phase = Phase.WARMING_UP
            await asyncio.wrap_future(self.batcher.call(self.warm_up))
        except Exception as exc:
            self.phase = Phase.FAILED
            self.error = str(exc) or type(exc).__name__
            log.exception("model %s could not start", self.settings.model)
            return
        assert self.warmup is not None and self.memory is not None and self.guard is not None
        self.phase = Phase.READY
        log.info("ready: %s on %s, batch size %d (%.1f images/s), warmup %.1f s; "
                 "%d bytes per image, budget %d bytes", self.model.name, self.device,
                 self.batcher.max_batch, self.warmup.throughput_at(self.batcher.max_batch),
                 self.warmup.duration_s, self.memory.fit.bytes_per_sample,
                 self.guard.budget_bytes)

    def stop(self) -> None:
        self.phase = Phase.STOPPED
        self.batcher.stop()

    async def classify(self, sample: Sample, timeout_s: float) -> Prediction:
        """Queue one preprocessed image for at most ``timeout_s``; raises Overloaded /
        DeadlineExceeded when busy, Paused while paused."""
        if not self.ready:
            raise NotReady(self.not_ready_message(), retry_after=5)
        if self.paused:
            raise Paused("vramguard is paused. Resume it from the tray or with "
                         "POST /v1/admin/resume.", retry_after=30)
        self._last_activity = time.monotonic()
        outcome = await self.batcher.infer(sample, timeout_s)
        assert isinstance(outcome, Prediction)
        return outcome

    def not_ready_message(self) -> str:
        if self.phase is Phase.FAILED:
            return f"The model could not be started: {self.error}"
        return "vramguard is still starting up (loading and warming up the model)."

    async def on_device(self, fn: object) -> object:
        """Run ``fn`` on the device thread and await it."""
        return await asyncio.wrap_future(self.batcher.call(fn))  # type: ignore[arg-type]

    # -- on the device thread --------------------------------------------------------------

    def load(self) -> LoadedModel:
        """Load the model on the calling thread (the server calls it on the device thread)."""
        model = load_model(self.settings.model, self.device, self.settings.weights)
        self.predictor = Predictor(model, keep_all=self.settings.cache)
        cap = int(self.settings.cpu_memory_cap) if self.settings.cpu_memory_cap else None
        self.probe = make_probe(self.device, weights_bytes(model), cap)
        return model

    def warm_up(self) -> None:
        """Time batch sizes, measure their memory, set up the guard (before any cap applies).

        Runs on the calling thread, like ``load``.
        """
        assert self.predictor is not None and self.probe is not None
        predictor, probe = self.predictor, self.probe
        self.warmup = profile(lambda size: predictor(predictor.random_batch(size)),
                              self.settings.max_batch_size, self.settings.target_latency_ms / 1000)
        tried = [t.batch_size for t in self.warmup.timings]
        points = []
        for size in (tried or batch_sizes(1))[:MEMORY_PROFILE_SIZES]:
            batch = predictor.random_batch(size)
            points.append((size, probe.measure_peak(lambda b=batch: predictor(b))))
        probe.empty_cache()
        reading = probe.read()
        overhead = reading.overhead
        self.memory = MemoryProfile(probe.weights, overhead, reading.others, fit_linear(points),
                                    points)
        budget = Budget(total=reading.total, fraction=self.settings.memory_fraction,
                        weights=probe.weights, overhead=overhead,
                        cap=int(self.settings.memory_budget) if self.settings.memory_budget
                        else None)
        chosen = self.settings.batch_size or self.warmup.chosen_batch_size
        self.guard = MemoryGuard(budget, self.memory.fit, max_batch=chosen,
                                 high=self.settings.high_watermark, low=self.settings.low_watermark)
        self._recovery = OomRecovery(predictor, self.guard, probe)
        probe.set_backstop(self.settings.memory_fraction)
        probe.reset_peak()
        self.batcher.set_max_batch(chosen)
        self.batcher.set_service_rate(self.warmup.throughput_at(chosen))

    def _batch_limit(self) -> int:
        if self.guard is None or self.probe is None:
            return self.batcher.max_batch
        return self.guard.max_batch_now(self.probe.in_use())

    def _run_batch(self, samples: list[Sample]) -> list[Outcome]:
        assert self._recovery is not None and self.guard is not None and self.probe is not None
        outcomes = self._recovery(samples)
        measured = self.probe.batch_peak()
        usage = measured if measured is not None else self.guard.fit.peak(len(samples))
        usage = max(usage, self.probe.held())
        self._peak_since_tick = max(self._peak_since_tick, usage)
        if self.guard.observe(usage) is GuardState.SHEDDING:
            self.probe.empty_cache()
        self._released = False
        return outcomes

    def tick(self) -> MemoryReading | None:
        """Once a second: follow other programs' memory, update the state, release when idle."""
        if self.guard is None or self.probe is None or self.memory is None:
            return None
        reading = self.probe.read()
        self.guard.shrink_for_others(reading.others - self.memory.others_at_start)
        usage, self._peak_since_tick = max(self._peak_since_tick, self.probe.held()), 0
        self.guard.observe(usage)
        idle = time.monotonic() - self._last_activity
        if (self.settings.idle_release_s and idle >= self.settings.idle_release_s
                and not self._released and self.batcher.queue_depth == 0):
            self.release()
            self.guard.counters.idle_releases += 1
            log.info("idle for %.0f s: cached memory given back", idle)
        self.last_report = self.memory_report()
        return reading

    def release(self) -> tuple[int, int]:
        """Empty the allocator cache and trust the profile again; bytes held before/after."""
        assert self.probe is not None and self.guard is not None
        before = self.probe.read().reserved
        self.probe.empty_cache()
        self.guard.relax()
        self._released = True
        return before, self.probe.read().reserved

    def memory_report(self) -> dict[str, object]:
        """Everything /v1/memory shows; call on the device thread."""
        if self.guard is None or self.probe is None or self.memory is None:
            return {"device": str(self.device), "state": "starting"}
        reading = self.probe.read()
        guard, counters = self.guard, self.guard.counters
        return {
            "device": reading.device,
            "source": reading.source,
            "nvml": reading.source == "nvml",
            "total_bytes": reading.total,
            "used_bytes": reading.used,
            "free_bytes": reading.free,
            "allocated_bytes": reading.allocated,
            "reserved_bytes": reading.reserved,
            "peak_allocated_bytes": reading.peak_allocated,
            "peak_reserved_bytes": reading.peak_reserved,
            "others_bytes": reading.others,
            "weights_bytes": self.memory.weights_bytes,
            "overhead_bytes": self.memory.overhead_bytes,
            "configured_budget_bytes": guard.configured_bytes,
            "budget_bytes": guard.budget_bytes,
            "low_watermark_bytes": guard.low_bytes,
            "high_watermark_bytes": guard.high_bytes,
            "usage_bytes": guard.usage,
            "state": guard.state.value,
            "fixed_bytes": guard.fit.fixed_bytes,
            "bytes_per_sample": guard.fit.bytes_per_sample,
            "profiled_bytes_per_sample": guard.profiled.bytes_per_sample,
            "profile_points": [{"batch_size": b, "peak_bytes": p} for b, p in self.memory.points],
            "max_batch_now": guard.max_batch_now(self.probe.in_use()),
            "cpu_memory_cap_bytes": getattr(self.probe, "cap", None),
            "process_used_bytes": self.probe.process_used(),
            "oom_events": counters.oom_events,
            "oom_recoveries": counters.oom_recoveries,
            "oom_failures": counters.oom_failures,
            "state_changes": counters.state_changes,
            "idle_releases": counters.idle_releases,
            "cache_empties": counters.cache_empties,
        }

    def reset_peak(self) -> tuple[int, int]:
        """Reset the peak figures; peak allocated bytes before/after."""
        assert self.probe is not None
        before = self.probe.read().peak_allocated
        self.probe.reset_peak()
        return before, self.probe.read().peak_allocated
