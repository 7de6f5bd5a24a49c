"""Calibration: what a model costs, measured at warmup or read from its stored profile, and
the runtime (guard, OOM recovery, adaptive batch size) built from it.

The rule: a profile is reused only for the same model, weights, device, driver and torch
(``ProfileKey``), and never one marked ``out_of_memory_on_load``; a measurement made short
of memory is stored so marked, so the next load measures again. Runs on the device thread.

A load made while the appliance serves (``first_only``) measures batch size 1 only: one
pass to warm up, one for its memory, one timed; the guard then allows one image per batch,
never an unmeasured size, and ``app.engine.profiling`` measures the rest between batches.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from app.config import Settings
from app.engine.batch_size import AdaptiveBatchSize
from app.engine.oom import (
    ErrorKind,
    NoEngine,
    OomRecovery,
    classify_error,
    unless_out_of_memory,
)
from app.engine.predictor import Predictor, Sample
from app.engine.profiles import ModelProfile, ProfileKey, ProfileStore, device_identity
from app.engine.residency import Footprint
from app.engine.runtime import Clock, LoadedModels, MemoryCost, Runtime, weights_bytes
from app.engine.warmup import (
    NEAR_TIE,
    BatchTiming,
    OutOfMemoryAtWarmup,
    Steps,
    WarmupTimings,
    choose_batch_size,
    profile_steps,
    run_through,
    timed,
)
from app.memory.fit import fit_linear
from app.memory.guard import MemoryGuard
from app.memory.probes import Probe
from app.memory.trim import give_back_to_os
from app.models import LoadedModel
from app.models.own.trial import folder_bytes
from app.models.precision import resolve
from app.models.registry import fingerprint

log = logging.getLogger("vramguard.engine")
MEMORY_PROFILE_SIZES = 4  # batch sizes 1, 2, 4, 8 (as far as warmup went)
Measured = tuple[WarmupTimings, list[tuple[int, int]], int]  # timings, memory points, size


class Calibration:
    """Measures models (or reuses their profiles) into runtimes, and predicts footprints."""

    def __init__(self, settings: Settings, models: LoadedModels, profiles: ProfileStore,
                 clock: Clock, locate: Callable[[str, Path | None], Path],
                 format_of: Callable[[str], str]) -> None:
        self.settings = settings
        self._locate = locate  # a model's weights file, or an own model's folder
        self._format_of = format_of  # a model's format (its family for a built-in)
        self.models = models
        self.profiles = profiles
        self._clock = clock
        self._fingerprints: dict[tuple[Path, int, int], str] = {}  # weights file -> version

    def profile_key(self, name: str, weights_version: str) -> ProfileKey:
        device, driver = device_identity(self.models.device)
        settings = self.settings
        runs_in = resolve(settings.precision, settings.channels_last, self.models.device,
                          self._format_of(name))
        return ProfileKey(name, weights_version, device, driver, torch.__version__,
                          runs_in.label)

    def weights_path(self, name: str) -> Path:
        return self._locate(name, self.settings.weights if name == self.settings.model
                            else None)

    def guess(self, name: str) -> Footprint:
        """What ``name`` will take: its stored profile's weights and batch, else its weights
        file's size (the batch is measured once loaded). The load itself reports a file
        that cannot be found or read."""
        try:
            path = self.weights_path(name)
            stat = path.stat()
        except Exception:
            return Footprint(0, 0)
        size = folder_bytes(path) if path.is_dir() else stat.st_size  # an own model's folder
        version = self._fingerprints.get((path, stat.st_mtime_ns, size))
        if version is None:
            version = fingerprint(path)
            self._fingerprints[(path, stat.st_mtime_ns, size)] = version
        stored = self.profiles.get(self.profile_key(name, version))
        if stored is None or stored.out_of_memory_on_load:
            return Footprint(size, 0)
        size = min(self.settings.batch_size or stored.chosen_batch_size, stored.points[-1][0])
        return Footprint(stored.weights_bytes, stored.footprint_peak(size))

    def mark_out_of_memory(self, name: str) -> None:
        """Keep in the profile that this model ran out of memory loading (copying its
        weights or warming up, in any of the forms CUDA has): the next load measures it
        again instead of trusting figures that did not hold."""
        stamps = [(path, version) for (path, _, _), version in self._fingerprints.items()]
        for path, version in stamps:
            if path != self.weights_path(name):
                continue
            stored = self.profiles.get(self.profile_key(name, version))
            if stored is not None:
                stored.out_of_memory_on_load = True
                self.profiles.put(stored)

    def runtime_for(self, model: LoadedModel, started: float, first_only: bool = False
                    ) -> tuple[Runtime, ModelProfile | None]:
        """Time batch sizes and measure their memory (or reuse the stored profile), then
        set up the guard (before any cap applies); the runtime, and the profile reused
        (None when measured). ``first_only``: measure batch size 1 only (the runtime's
        ``profile_complete`` is False). OutOfMemoryAtWarmup when the device ran out."""
        models, settings = self.models, self.settings
        predictor = Predictor(model, keep_all=settings.cache)
        size = weights_bytes(model)
        probe = models.the_probe()
        models.set_weights(models.weights_total() + size)
        key = self.profile_key(model.name, model.weights_version)
        stored = self.profiles.get(key)
        reused = stored if stored is not None and not stored.out_of_memory_on_load else None
        ooms = probe.allocator_ooms()
        try:
            if reused is not None:
                warmup, points, chosen = self._reuse(predictor, probe, reused, started)
            elif first_only:
                warmup, points, chosen = self._measure_first(predictor, probe, started)
            else:
                warmup, points, chosen = run_through(self.measure_steps(predictor, probe))
                self.store(key, size, warmup, points, chosen)
        except Exception as exc:
            models.set_weights(models.weights_total())
            if isinstance(exc, OutOfMemoryAtWarmup):
                raise OutOfMemoryAtWarmup() from None
            kind = classify_error(exc, probe.allocator_ooms() > ooms)
            if kind is ErrorKind.OUT_OF_MEMORY:
                raise OutOfMemoryAtWarmup() from None
            if kind is ErrorKind.NO_ENGINE:
                raise NoEngine(exc) from exc
            raise
        probe.empty_cache()
        give_back_to_os()  # warmup's largest batch would stay resident on the host
        probe.set_baseline()
        reading = probe.read()
        if models.others_at_start is None:
            models.others_at_start = reading.others
        memory = MemoryCost(size, reading.overhead, models.others_at_start,
                               fit_linear(points), points)
        budget = models.rebase(reading, models.weights_total() + size)
        guard = MemoryGuard(budget, memory.fit, max_batch=chosen,
                            high=settings.high_watermark, low=settings.low_watermark)
        models.set_backstop()
        probe.reset_peak()
        adaptive = self.adaptive(warmup, points, chosen)
        if reused is not None:
            log.info("%s: reused the profile measured on %s for this model, device and "
                     "versions (%s)", model.name,
                     time.strftime("%Y-%m-%d %H:%M", time.localtime(reused.measured_at)),
                     self.profiles.folder / key.file_name())
        return Runtime(model, predictor, probe, guard, OomRecovery(predictor, guard, probe),
                       memory, warmup, reused is not None, adaptive,
                       profile_complete=reused is not None or not first_only), reused

    def store(self, key: ProfileKey, weights: int, warmup: WarmupTimings,
              points: list[tuple[int, int]], chosen: int) -> None:
        """Keep a whole measurement for the next load. One made short of memory (another
        program, a model not unloaded yet) is kept so marked: the next load measures
        again."""
        self.profiles.put(ModelProfile(
            key, weights, fit_linear(points), points, warmup.timings, chosen,
            warmup.out_of_memory_at,
            out_of_memory_on_load=warmup.out_of_memory_at is not None))

    def adaptive(self, warmup: WarmupTimings, points: list[tuple[int, int]], chosen: int
                 ) -> AdaptiveBatchSize | None:
        """The batch size that follows service, starting from a measurement (None when
        the size is set by hand)."""
        settings = self.settings
        return None if settings.batch_size else AdaptiveBatchSize(
            [(t.batch_size, t.seconds) for t in warmup.timings], initial=chosen,
            max_size=max(chosen, self._ceiling(warmup, points)),
            target_latency_s=settings.target_latency_ms / 1000)

    @staticmethod
    def _ceiling(warmup: WarmupTimings, points: list[tuple[int, int]]) -> int:
        """The largest batch size service may move to: measured in memory, and not past a
        size warmup timed as slower per image than the best (a CPU's cost per image rises
        with the batch, which the a + b x n line cannot represent)."""
        best = max(t.images_per_second for t in warmup.timings)
        timed = max(t.batch_size for t in warmup.timings
                    if t.images_per_second >= NEAR_TIE * best)
        return min(timed, points[-1][0])

    def _reuse(self, predictor: Predictor, probe: Probe, stored: ModelProfile,
               started: float) -> Measured:
        """A stored profile instead of the measurement. One pass at the chosen batch size
        still runs, so that the first request does not pay for the first pass's setup, and
        so that the C allocator and torch's kernels start where a measurement leaves them:
        after a pass of one image only, every later lone image took 27 ms instead of 21
        (EfficientNet-Lite0, 2-core CPU; 22 ms after a pass of 4). A profile measured
        with more room than there is now may not fit that pass: one image then warms up,
        and the memory guard sizes the batches as the memory in use allows."""
        timings = [t for t in stored.timings if t.batch_size <= self.settings.max_batch_size]
        chosen = self.settings.batch_size or choose_batch_size(
            timings or stored.timings[:1], self.settings.target_latency_ms / 1000)
        chosen = min(chosen, stored.points[-1][0])
        ooms = probe.allocator_ooms()
        try:
            predictor(predictor.random_batch(chosen))
        except Exception as exc:
            if chosen == 1 or classify_error(
                    exc, probe.allocator_ooms() > ooms) is not ErrorKind.OUT_OF_MEMORY:
                raise
            log.warning("%s: a batch of %d no longer fits in memory while loading; warming "
                        "up with one image", stored.key.model, chosen)
            probe.empty_cache()
            predictor(predictor.random_batch(1))
        return stored.warmup(self._clock() - started), list(stored.points), chosen

    def _measure_first(self, predictor: Predictor, probe: Probe, started: float
                       ) -> Measured:
        """Batch size 1 only: a pass that pays for the first pass's setup, its memory
        peak, its time. What serving needs to start; the rest comes between batches."""
        batch = predictor.random_batch(1)
        predictor(batch)
        peak = unless_out_of_memory(
            functools.partial(probe.measure_peak, functools.partial(predictor, batch)),
            probe.allocator_ooms)
        took = timed(predictor, batch, ooms=probe.allocator_ooms)
        if peak is None or took is None:
            probe.empty_cache()
            raise OutOfMemoryAtWarmup()
        return (WarmupTimings([BatchTiming(1, took)], 1, self._clock() - started),
                [(1, peak)], 1)

    def measure_steps(self, predictor: Predictor, probe: Probe) -> Steps[Measured]:
        """Time batch sizes and measure each one's memory, a step after each pass; the
        chosen size fits."""
        pool: list[Sample] = []

        def inputs(size: int) -> list[Sample]:
            """The first ``size`` of one growing set of random inputs: built once, reused
            by every size and repeat (the sizes together would hold twice the memory)."""
            if len(pool) < size:
                pool.extend(predictor.random_batch(size - len(pool)))
            return pool[:size]

        warmup = yield from profile_steps(predictor, self.settings.max_batch_size,
                                          self.settings.target_latency_ms / 1000,
                                          build=inputs, free=probe.empty_cache,
                                          ooms=probe.allocator_ooms)
        chosen = self.settings.batch_size or warmup.chosen_batch_size
        tried = [t.batch_size for t in warmup.timings]
        if warmup.out_of_memory_at is not None and chosen >= warmup.out_of_memory_at:
            log.warning("batch size %d does not fit in memory: using %d", chosen, tried[-1])
            chosen = tried[-1]
        points = yield from memory_point_steps(predictor, probe, inputs, tried, chosen)
        pool.clear()
        if points[-1][0] < chosen:
            log.warning("batch size %d does not fit in memory: using %d", chosen,
                        points[-1][0])
            chosen = points[-1][0]
        return warmup, points, chosen

    def remeasure(self, name: str, key: ProfileKey) -> None:
        """An old profile was reused at load: measure again, between batches, for the next
        load (a machine drifts; the live figures are corrected by serving itself)."""
        runtime = self.models.runtimes.get(name)
        if runtime is None:
            return
        warmup, points, chosen = run_through(self.measure_steps(runtime.predictor,
                                                                runtime.probe))
        runtime.probe.empty_cache()
        self.profiles.put(ModelProfile(key, runtime.memory.weights_bytes, fit_linear(points),
                                       points, warmup.timings, chosen,
                                       warmup.out_of_memory_at))
        log.info("%s: profile measured again (the stored one was over 30 days old)", name)


def memory_point_steps(predictor: Predictor, probe: Probe,
                       inputs: Callable[[int], list[Sample]], tried: list[int], chosen: int
                       ) -> Steps[list[tuple[int, int]]]:
    """Peak memory of a batch at the first sizes tried, at the largest tried and at the
    chosen one, smallest first, up to the first that runs out of memory; a step after each.

    The small sizes give the slope; the large ones are measured because cuDNN picks an
    algorithm per shape and its workspace can jump with the batch size, which no
    extrapolation from 1-8 would show (the fit is then raised to cover them)."""
    sizes = sorted({*tried[:MEMORY_PROFILE_SIZES], tried[-1], chosen})
    points: list[tuple[int, int]] = []
    for size in sizes:
        batch = inputs(size)
        peak = unless_out_of_memory(
            functools.partial(probe.measure_peak, functools.partial(predictor, batch)),
            probe.allocator_ooms)
        if peak is None:
            probe.empty_cache()
            if not points:
                raise OutOfMemoryAtWarmup()
            break
        points.append((size, peak))
        yield
    return points
