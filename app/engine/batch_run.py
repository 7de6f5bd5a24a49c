"""Running one batch on the device thread: sized by the memory guard, through the OOM
recovery, timed for the adaptive batch size and the CPU's thread count, its memory peak
shown to every guard.

The rules: a batch split by an OOM recovery is not timed (its time is not a batch's); a
sticky CUDA error, in the forward pass or in the memory calls around it, fails the engine
for good, and no batch queued before it touches the device again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from app.engine.batcher import MicroBatcher
from app.engine.cpu_threads import CpuThreads
from app.engine.oom import DeviceFailed, ErrorKind, Outcome, classify_error, first_line
from app.engine.predictor import Sample
from app.engine.runtime import Health, LoadedModels, Runtime
from app.memory.allocations import LargeAllocationWatch
from app.schemas import GuardState

log = logging.getLogger("vramguard.engine")


class BatchRun:
    """Each lane's ``run_batch`` and ``batch_limit``; ``after_batch`` hears each batch's
    memory use (the upkeep's peak since the last tick)."""

    def __init__(self, models: LoadedModels, batcher: MicroBatcher[Sample, Outcome],
                 health: Health, allocations: LargeAllocationWatch,
                 cpu_threads: CpuThreads | None, after_batch: Callable[[int], None]) -> None:
        self.models = models
        self.batcher = batcher
        self.health = health
        self.allocations = allocations
        self.cpu_threads = cpu_threads
        self.after_batch = after_batch

    def limit(self, name: str) -> int:
        """Images of ``name`` that fit in a batch now (the memory guard's answer)."""
        runtime = self.models.runtimes.get(name)
        if runtime is None:
            return 0
        return runtime.guard.max_batch_now(runtime.probe.in_use())

    def run(self, name: str, samples: list[Sample]) -> list[Outcome]:
        runtime = self.models.runtimes.get(name)
        if runtime is None:
            raise RuntimeError(f"a batch of {name} ran while it was not loaded")
        health = self.health
        if health.device_lost:  # queued before it failed: never touch the broken device
            raise health.not_ready()
        guard, probe = runtime.guard, runtime.probe
        if self.cpu_threads is not None:
            self.cpu_threads.fit(self.batcher.backlog > 0, name, len(samples))
        ooms = guard.counters.oom_events
        started = time.perf_counter()
        try:
            with self.allocations.batch(probe, len(samples),
                                        guard.profiled.peak(len(samples))):
                outcomes = runtime.recovery(samples)
        except DeviceFailed as exc:
            health.device_failed(str(exc))
            raise health.not_ready() from None
        except Exception as exc:  # a sticky error raised outside the forward pass
            if classify_error(exc) is ErrorKind.DEVICE_LOST:  # (the recovery's empty_cache)
                health.device_failed(first_line(exc))
                raise health.not_ready() from None
            raise
        self.models.counted(name).sizes[len(samples)] += 1
        took = time.perf_counter() - started if guard.counters.oom_events == ooms else None
        if self.cpu_threads is not None:
            self.cpu_threads.record(took)
        if runtime.batch_size is not None and took is not None:
            self._adapt(name, runtime, len(samples), took)
        try:
            self._after(runtime, len(samples))
        except Exception as exc:
            if classify_error(exc) is ErrorKind.DEVICE_LOST:
                health.device_failed(first_line(exc))
                log.exception("the GPU failed after a batch of %s", name)
            else:
                raise
        return outcomes

    def _after(self, runtime: Runtime, images: int) -> None:
        """The batch's memory use, shown to every guard; the cache given back when they
        shed. Its answers are kept if the device fails here: they are already computed."""
        guard, probe = runtime.guard, runtime.probe
        # Tensor bytes, as admission counts them: the cache's free blocks serve the next
        # batch, and counted here a warm cache alone would push a small GPU into shedding.
        measured = probe.batch_peak()
        usage = measured if measured is not None else guard.fit.peak(images)
        self.after_batch(usage)
        if self.models.observe(usage) is GuardState.SHEDDING:
            probe.empty_cache()

    def _adapt(self, name: str, runtime: Runtime, images: int, seconds: float) -> None:
        """Feed a batch's time to the model's batch-size estimate; move its batch size
        when the estimate says so."""
        adaptive, guard = runtime.batch_size, runtime.guard
        assert adaptive is not None
        adaptive.observe(images, seconds,
                         memory_limit=max(1, guard.max_batch_now(runtime.probe.in_use())))
        if adaptive.size != guard.max_batch:
            log.info("%s: batch size %d -> %d (batch time now %.1f ms + %.2f ms per image)",
                     name, guard.max_batch, adaptive.size, adaptive.fit.line.a * 1000,
                     adaptive.fit.line.b * 1000)
            guard.max_batch = adaptive.size
            self.batcher.set_max_batch(adaptive.size, name)
            resident = self.models.residents.get(name)
            if resident is not None:
                resident.footprint = runtime.footprint
