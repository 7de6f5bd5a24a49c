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
from pathlib import Path
from typing import TypeVar

import torch

from app.config import Settings
from app.engine.batcher import MicroBatcher, Reservation
from app.engine.cpu_threads import CpuThreads
from app.engine.device import cpu_fallback_reason, resolve_device
from app.engine.oom import DeviceFailed, OomRecovery, Outcome, unless_out_of_memory
from app.engine.predictor import Prediction, Predictor, Sample
from app.engine.warmup import OutOfMemoryAtWarmup, WarmupProfile, profile
from app.errors import InsufficientMemory, NotReady, Paused
from app.memory.allocations import LargeAllocationWatch
from app.memory.budget import Budget
from app.memory.diagnostics import IDLE_PERIOD_S, IdleFindings, MemoryDiagnostics
from app.memory.fit import MemoryFit, fit_linear
from app.memory.guard import GuardState, MemoryGuard
from app.memory.probes import CpuProbe, CudaProbe, MemoryReading, Probe, make_probe
from app.models import LoadedModel, load_model
from app.schemas import MemoryReport, ProfilePoint
from app.units import human_bytes

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
        self.cpu_instead_of_gpu = cpu_fallback_reason(settings.device)
        self.phase = Phase.STARTING
        self.error: str | None = None
        # A sticky CUDA error broke the device's context: no restart of it in-process.
        self.device_lost = False
        self.runtime: Runtime | None = None
        self._peak_since_tick = 0
        self._last_activity = time.monotonic()
        self._released = True
        self._batches_at_idle = 0  # batches served when the last idle period was diagnosed
        self.diagnostics: MemoryDiagnostics | None = None
        self._allocations = LargeAllocationWatch(int(settings.large_allocation_bytes))
        self._recording_stacks = False
        self._leak_snapshot: Path | None = None
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
        if self.phase is Phase.FAILED and self.device_lost:
            return (f"The graphics card stopped working ({self.error}) and cannot be used "
                    "again by this vramguard. Quit vramguard and start it again; if it "
                    "happens again, restart the computer.")
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
        pool: list[Sample] = []

        def inputs(size: int) -> list[Sample]:
            """The first ``size`` of one growing set of random inputs: built once, reused
            by every size and repeat (the sizes together would hold twice the memory)."""
            if len(pool) < size:
                pool.extend(predictor.random_batch(size - len(pool)))
            return pool[:size]

        warmup = profile(predictor, self.settings.max_batch_size,
                         self.settings.target_latency_ms / 1000, build=inputs,
                         free=probe.empty_cache)
        chosen = self.settings.batch_size or warmup.chosen_batch_size
        tried = [t.batch_size for t in warmup.timings]
        if warmup.out_of_memory_at is not None and chosen >= warmup.out_of_memory_at:
            log.warning("batch size %d does not fit in memory: using %d", chosen, tried[-1])
            chosen = tried[-1]
        points = self._memory_points(predictor, probe, inputs, tried, chosen)
        pool.clear()
        if points[-1][0] < chosen:
            log.warning("batch size %d does not fit in memory: using %d", chosen,
                        points[-1][0])
            chosen = points[-1][0]
        probe.empty_cache()
        probe.set_baseline()
        reading = probe.read()
        memory = MemoryProfile(probe.weights, reading.overhead, reading.others,
                               fit_linear(points), points)
        budget = Budget(total=reading.total, fraction=self.settings.memory_fraction,
                        weights=probe.weights, workspaces=probe.workspaces,
                        overhead=reading.overhead,
                        cap=int(self.settings.memory_budget) if self.settings.memory_budget
                        else None)
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

    @staticmethod
    def _memory_points(predictor: Predictor, probe: Probe,
                       inputs: Callable[[int], list[Sample]], tried: list[int],
                       chosen: int) -> list[tuple[int, int]]:
        """Peak memory of a batch at the first sizes tried, at the largest tried and at the
        chosen one, smallest first, up to the first that runs out of memory.

        The small sizes give the slope; the large ones are measured because cuDNN picks
        an algorithm per shape and its workspace can jump with the batch size, which no
        extrapolation from 1-8 would show (the fit is then raised to cover them)."""
        sizes = sorted({*tried[:MEMORY_PROFILE_SIZES], tried[-1], chosen})
        points: list[tuple[int, int]] = []
        for size in sizes:
            batch = inputs(size)
            peak = unless_out_of_memory(
                functools.partial(probe.measure_peak, functools.partial(predictor, batch)))
            if peak is None:
                probe.empty_cache()
                if not points:
                    raise OutOfMemoryAtWarmup()
                break
            points.append((size, peak))
        return points

    def _batch_limit(self) -> int:
        if self.runtime is None:
            return self.batcher.max_batch
        return self.runtime.guard.max_batch_now(self.runtime.probe.in_use())

    def _run_batch(self, samples: list[Sample]) -> list[Outcome]:
        runtime = self.runtime
        if runtime is None:
            raise RuntimeError("a batch ran before warmup finished")
        if self.device_lost:  # queued before it failed: never touch the broken device again
            raise NotReady(self.not_ready_message(), retry_after=5)
        guard, probe = runtime.guard, runtime.probe
        if self._cpu_threads is not None:
            self._cpu_threads.fit(others_busy=self.batcher.backlog > 0)
        try:
            with self._allocations.batch(probe, len(samples),
                                         guard.profiled.peak(len(samples))):
                outcomes = runtime.recovery(samples)
        except DeviceFailed as exc:
            self.phase, self.error, self.device_lost = Phase.FAILED, str(exc), True
            raise NotReady(self.not_ready_message(), retry_after=5) from None
        measured = probe.batch_peak()
        usage = measured if measured is not None else guard.fit.peak(len(samples))
        usage = max(usage, probe.held())
        self._peak_since_tick = max(self._peak_since_tick, usage)
        if guard.observe(usage) is GuardState.SHEDDING:
            probe.empty_cache()
        self._released = False
        return outcomes

    def tick(self) -> MemoryReading | None:
        """Once a second: follow other programs' memory, update the state; once per quiet
        spell after work, diagnose memory and give the cache back."""
        runtime = self.runtime
        if runtime is None:
            return None
        guard, probe = runtime.guard, runtime.probe
        reading = probe.read()
        guard.shrink_for_others(reading.others - runtime.memory.others_at_start)
        usage, self._peak_since_tick = max(self._peak_since_tick, probe.held()), 0
        guard.observe(usage)
        idle = time.monotonic() - self._last_activity
        batches = self.batcher.stats.batches
        if (idle >= (self.settings.idle_release_s or IDLE_PERIOD_S)
                and batches != self._batches_at_idle and self.batcher.queue_depth == 0):
            self._batches_at_idle = batches
            self._idle_period(runtime, idle)
        self.last_report = self._report(runtime)
        return reading

    def _idle_period(self, runtime: Runtime, idle: float) -> None:
        """Diagnose what tensors still hold with nothing running, then give the cache back:
        always with idle release on, and whatever the setting when it is fragmented."""
        reading = runtime.probe.read()
        found = self._diagnostics(reading).idle(reading.allocated, reading.reserved)
        if found.fragmented or (self.settings.idle_release_s and not self._released):
            self._release(runtime)
            runtime.guard.counters.idle_releases += 1
            log.info("idle for %.0f s: cached memory given back%s", idle,
                     " (it held 5 or more times what was in use: fragmented)"
                     if found.fragmented else "")
        if isinstance(runtime.probe, CudaProbe):
            self._trace_leak(found)
        if found.leak_raised:
            diagnostics = self._diagnostics(reading)
            log.warning("possible memory leak: after each quiet spell vramguard keeps more "
                        "memory in use than after the one before, now %s more than after "
                        "warmup (levels: %s). Something keeps old work in memory; restarting "
                        "vramguard gives it back.%s", human_bytes(diagnostics.leak_growth),
                        ", ".join(human_bytes(level) for level in diagnostics.baselines),
                        f" Allocator snapshot: {self._leak_snapshot}"
                        if self._leak_snapshot else "")

    def _diagnostics(self, reading: MemoryReading) -> MemoryDiagnostics:
        """The diagnostics, started from the first reading after warmup (the warm level)."""
        if self.diagnostics is None:
            self.diagnostics = MemoryDiagnostics(reading.allocated)
        return self.diagnostics

    def _trace_leak(self, found: IdleFindings) -> None:
        """CUDA only. From the first rise of memory left in use until it falls back, the
        allocator keeps the Python stack of each live block (about 2 us per allocation),
        so that the snapshot written the first time a leak is suspected shows where the
        kept tensors were made; it is opened at pytorch.org/memory_viz."""
        memory = torch.cuda.memory
        if self._leak_snapshot is None and found.rising and not self._recording_stacks:
            memory._record_memory_history(enabled="state", context="state", stacks="python")
            self._recording_stacks = True
        if found.leak_raised and self._leak_snapshot is None:
            path = self.settings.log_dir / time.strftime("leak-snapshot-%Y%m%d-%H%M%S.pickle")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                memory._dump_snapshot(str(path))  # type: ignore[no-untyped-call]  # no hints
                self._leak_snapshot = path
            except (OSError, RuntimeError) as exc:
                log.warning("could not write the allocator snapshot %s: %s", path, exc)
        if self._recording_stacks and (self._leak_snapshot is not None or not found.rising):
            memory._record_memory_history(enabled=None)
            self._recording_stacks = False

    def release(self) -> tuple[int, int]:
        """Empty the allocator cache and trust the profile again; bytes held before/after."""
        return self._release(self.require_runtime())

    def _release(self, runtime: Runtime) -> tuple[int, int]:
        before = runtime.probe.read().reserved
        runtime.probe.empty_cache()
        runtime.guard.relax()
        self._released = True
        return before, runtime.probe.read().reserved

    def memory_report(self) -> MemoryReport:
        """Everything /v1/memory shows; call on the device thread."""
        return self._report(self.require_runtime())

    def _report(self, runtime: Runtime) -> MemoryReport:
        probe, guard, memory = runtime.probe, runtime.guard, runtime.memory
        reading = probe.read()
        counters = guard.counters
        diagnostics = self._diagnostics(reading)
        nvml = probe.nvml if isinstance(probe, CudaProbe) else None
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
            fragmentation_releases=diagnostics.fragmentation_releases,
            leak_suspected=diagnostics.leak_suspected,
            leak_growth_bytes=diagnostics.leak_growth,
            idle_baselines_bytes=list(diagnostics.baselines),
            large_allocations=self._allocations.logged,
            gpu_utilization_ratio=nvml.utilization() if nvml is not None else None,
            cpu_instead_of_gpu=self.cpu_instead_of_gpu,
        )

    def reset_peak(self) -> tuple[int, int]:
        """Reset the peak figures; peak allocated bytes before/after."""
        probe = self.require_runtime().probe
        before = probe.read().peak_allocated
        probe.reset_peak()
        return before, probe.read().peak_allocated
