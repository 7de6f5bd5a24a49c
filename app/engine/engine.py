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
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from app.config import Settings
from app.engine.batcher import MicroBatcher, Reservation
from app.engine.cpu_threads import CpuThreads
from app.engine.device import resolve_device
from app.engine.oom import OomRecovery, Outcome
from app.engine.predictor import Prediction, Predictor, Sample
from app.engine.warmup import WarmupProfile, batch_sizes, profile
from app.errors import InsufficientMemory, NotReady, Paused
from app.memory.budget import Budget
from app.memory.fit import MemoryFit, fit_linear
from app.memory.guard import GuardState, MemoryGuard
from app.memory.probes import CpuProbe, MemoryReading, Probe, make_probe
from app.models import LoadedModel, load_model
from app.schemas import MemoryReport, ProfilePoint

log = logging.getLogger("vramguard.engine")
GPU_DEFAULT_WAIT_S = 0.002
MEMORY_PROFILE_SIZES = 4  # batch sizes 1, 2, 4, 8 (as far as warmup went)
T = TypeVar("T")


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


@dataclass(frozen=True)
class Runtime:
    """A loaded, warmed-up model and everything measured about it: they exist together."""

    model: LoadedModel
    predictor: Predictor
    probe: Probe
    guard: MemoryGuard
    recovery: OomRecovery
    memory: MemoryProfile
    warmup: WarmupProfile


def weights_bytes(model: LoadedModel) -> int:
    module = model.module
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


class InferenceEngine:
    """Owns the batcher and, once warmed up, the runtime; ``start`` must finish before
    ``classify``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.phase = Phase.STARTING
        self.error: str | None = None
        self.runtime: Runtime | None = None
        self._peak_since_tick = 0
        self._last_activity = time.monotonic()
        self._released = True
        self.paused = False
        self.last_report: MemoryReport | None = None
        wait_s = settings.max_wait_ms / 1000 if settings.max_wait_ms is not None else (
            GPU_DEFAULT_WAIT_S if self.device.type == "cuda" else 0.0)
        self._cpu_threads = CpuThreads() if self.device.type == "cpu" else None
        self.batcher: MicroBatcher[Sample, Outcome] = MicroBatcher(
            self._run_batch, max_batch=1, max_wait_s=wait_s, queue_size=settings.queue_size,
            batch_limit=self._batch_limit)

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    def require_runtime(self) -> Runtime:
        """The runtime of a ready engine; NotReady (503) before warmup has finished."""
        if not self.ready or self.runtime is None:
            raise NotReady(self.not_ready_message(), retry_after=5)
        return self.runtime

    def require_unpaused(self) -> None:
        """Paused (503) while an admin has paused the appliance; the route checks it before
        reading an upload, so cached answers stop too."""
        if self.paused:
            raise Paused("vramguard is paused. Resume it from the tray or with "
                         "POST /v1/admin/resume.", retry_after=30)

    async def start(self) -> None:
        """Load the model and run warmup on the device thread; record any failure."""
        self.batcher.start()
        try:
            self.phase = Phase.LOADING
            model = await self.on_device(self.load)
            self.phase = Phase.WARMING_UP
            runtime = await self.on_device(functools.partial(self.warm_up, model))
        except Exception as exc:
            self.phase = Phase.FAILED
            self.error = str(exc) or type(exc).__name__
            log.exception("model %s could not start", self.settings.model)
            return
        self.phase = Phase.READY
        log.info("ready: %s on %s, batch size %d (%.1f images/s), warmup %.1f s; "
                 "%d bytes per image, budget %d bytes", runtime.model.name, self.device,
                 self.batcher.max_batch, runtime.warmup.throughput_at(self.batcher.max_batch),
                 runtime.warmup.duration_s, runtime.memory.fit.bytes_per_sample,
                 runtime.guard.budget_bytes)

    def stop(self) -> None:
        self.phase = Phase.STOPPED
        self.batcher.stop()

    def admit(self, timeout_s: float) -> Reservation:
        """A place in line for an image not read yet, or Overloaded (503) at once when its
        answer could not come within ``timeout_s``: refused before its upload is read."""
        return self.batcher.reserve(timeout_s)

    async def classify(self, sample: Sample, timeout_s: float,
                       reservation: Reservation | None = None) -> Prediction:
        """Queue one preprocessed image (in its reserved place) for at most ``timeout_s``;
        raises Overloaded / DeadlineExceeded when busy, Paused while paused."""
        self.require_runtime()
        self.require_unpaused()
        self._last_activity = time.monotonic()
        outcome = await self.batcher.infer(sample, timeout_s, reservation)
        if isinstance(outcome, InsufficientMemory):
            raise outcome
        return outcome

    def not_ready_message(self) -> str:
        if self.phase is Phase.FAILED:
            return f"The model could not be started: {self.error}"
        if self.phase is Phase.STOPPED:
            return "vramguard is shutting down."
        return "vramguard is still starting up (loading and warming up the model)."

    async def on_device(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the device thread and await it."""
        return await asyncio.wrap_future(self.batcher.call(fn))

    # -- on the device thread --------------------------------------------------------------

    def load(self) -> LoadedModel:
        """Load the model on the calling thread (the server calls it on the device thread)."""
        return load_model(self.settings.model, self.device, self.settings.weights)

    def warm_up(self, model: LoadedModel) -> Runtime:
        """Time batch sizes, measure their memory, set up the guard (before any cap applies),
        and install the runtime. Runs on the calling thread, like ``load``."""
        predictor = Predictor(model, keep_all=self.settings.cache)
        cap = int(self.settings.cpu_memory_cap) if self.settings.cpu_memory_cap else None
        probe = make_probe(self.device, weights_bytes(model), cap)
        warmup = profile(lambda size: predictor(predictor.random_batch(size)),
                         self.settings.max_batch_size, self.settings.target_latency_ms / 1000)
        tried = [t.batch_size for t in warmup.timings]
        points = []
        for size in (tried or batch_sizes(1))[:MEMORY_PROFILE_SIZES]:
            batch = predictor.random_batch(size)
            points.append((size, probe.measure_peak(functools.partial(predictor, batch))))
        probe.empty_cache()
        reading = probe.read()
        memory = MemoryProfile(probe.weights, reading.overhead, reading.others,
                               fit_linear(points), points)
        budget = Budget(total=reading.total, fraction=self.settings.memory_fraction,
                        weights=probe.weights, overhead=reading.overhead,
                        cap=int(self.settings.memory_budget) if self.settings.memory_budget
                        else None)
        chosen = self.settings.batch_size or warmup.chosen_batch_size
        guard = MemoryGuard(budget, memory.fit, max_batch=chosen,
                            high=self.settings.high_watermark, low=self.settings.low_watermark)
        probe.set_backstop(self.settings.memory_fraction)
        probe.reset_peak()
        self.batcher.set_max_batch(chosen)
        self.batcher.set_service_rate(warmup.throughput_at(chosen))
        runtime = Runtime(model, predictor, probe, guard, OomRecovery(predictor, guard, probe),
                          memory, warmup)
        self.runtime = runtime
        # Published before the engine says ready, so /metrics has every memory series
        # from the first scrape after /readyz answers 200.
        self.last_report = self._report(runtime)
        return runtime

    def _batch_limit(self) -> int:
        if self.runtime is None:
            return self.batcher.max_batch
        return self.runtime.guard.max_batch_now(self.runtime.probe.in_use())

    def _run_batch(self, samples: list[Sample]) -> list[Outcome]:
        runtime = self.runtime
        if runtime is None:
            raise RuntimeError("a batch ran before warmup finished")
        guard, probe = runtime.guard, runtime.probe
        if self._cpu_threads is not None:
            self._cpu_threads.fit(others_busy=self.batcher.backlog > 0)
        outcomes = runtime.recovery(samples)
        measured = probe.batch_peak()
        usage = measured if measured is not None else guard.fit.peak(len(samples))
        usage = max(usage, probe.held())
        self._peak_since_tick = max(self._peak_since_tick, usage)
        if guard.observe(usage) is GuardState.SHEDDING:
            probe.empty_cache()
        self._released = False
        return outcomes

    def tick(self) -> MemoryReading | None:
        """Once a second: follow other programs' memory, update the state, release when idle."""
        runtime = self.runtime
        if runtime is None:
            return None
        guard, probe = runtime.guard, runtime.probe
        reading = probe.read()
        guard.shrink_for_others(reading.others - runtime.memory.others_at_start)
        usage, self._peak_since_tick = max(self._peak_since_tick, probe.held()), 0
        guard.observe(usage)
        idle = time.monotonic() - self._last_activity
        if (self.settings.idle_release_s and idle >= self.settings.idle_release_s
                and not self._released and self.batcher.queue_depth == 0):
            self.release()
            guard.counters.idle_releases += 1
            log.info("idle for %.0f s: cached memory given back", idle)
        self.last_report = self._report(runtime)
        return reading

    def release(self) -> tuple[int, int]:
        """Empty the allocator cache and trust the profile again; bytes held before/after."""
        runtime = self.require_runtime()
        before = runtime.probe.read().reserved
        runtime.probe.empty_cache()
        runtime.guard.relax()
        self._released = True
        return before, runtime.probe.read().reserved

    def memory_report(self) -> MemoryReport:
        """Everything /v1/memory shows; call on the device thread."""
        return self._report(self.require_runtime())

    @staticmethod
    def _report(runtime: Runtime) -> MemoryReport:
        probe, guard, memory = runtime.probe, runtime.guard, runtime.memory
        reading = probe.read()
        counters = guard.counters
        return MemoryReport(
            device=reading.device,
            source=reading.source,
            nvml=reading.source == "nvml",
            total_bytes=reading.total,
            used_bytes=reading.used,
            free_bytes=reading.free,
            allocated_bytes=reading.allocated,
            reserved_bytes=reading.reserved,
            peak_allocated_bytes=reading.peak_allocated,
            peak_reserved_bytes=reading.peak_reserved,
            others_bytes=reading.others,
            weights_bytes=memory.weights_bytes,
            overhead_bytes=memory.overhead_bytes,
            configured_budget_bytes=guard.configured_bytes,
            budget_bytes=guard.budget_bytes,
            low_watermark_bytes=guard.low_bytes,
            high_watermark_bytes=guard.high_bytes,
            usage_bytes=guard.usage,
            state=guard.state,
            fixed_bytes=guard.fit.fixed_bytes,
            bytes_per_sample=guard.fit.bytes_per_sample,
            profiled_bytes_per_sample=guard.profiled.bytes_per_sample,
            profile_points=[ProfilePoint(batch_size=b, peak_bytes=p) for b, p in memory.points],
            max_batch_now=guard.max_batch_now(probe.in_use()),
            cpu_memory_cap_bytes=probe.cap if isinstance(probe, CpuProbe) else None,
            process_used_bytes=probe.process_used(),
            oom_events=counters.oom_events,
            oom_recoveries=counters.oom_recoveries,
            oom_failures=counters.oom_failures,
            state_changes=counters.state_changes,
            idle_releases=counters.idle_releases,
            cache_empties=counters.cache_empties,
        )

    def reset_peak(self) -> tuple[int, int]:
        """Reset the peak figures; peak allocated bytes before/after."""
        probe = self.require_runtime().probe
        before = probe.read().peak_allocated
        probe.reset_peak()
        return before, probe.read().peak_allocated
