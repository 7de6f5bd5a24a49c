"""The inference engine: one device thread, the models loaded on it, one memory guard
budget shared by all of them.

It loads models and runs warmup on the device thread (so that thread is the only one
that ever touches the GPU), measures what a batch costs in memory, then serves
``classify`` calls from the event loop, which only awaits futures. Every forward pass
goes through the OOM recovery; every batch is sized by the guard.

Several models share the device. The ``--model`` one (and ``--models``) load at start
and stay; any other catalogue model loads when a request asks for it, after unloading
idle ones least recently used first when it would not fit, measured (see
``app.engine.residency``), and unloads after its keep-alive. Each model has its own
lane in the batcher, and the lanes take turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import gc
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from app.config import Settings
from app.engine.batch_size import AdaptiveBatchSize
from app.engine.batcher import MicroBatcher, Reservation
from app.engine.cpu_threads import CpuThreads
from app.engine.device import cpu_fallback_reason, resolve_device
from app.engine.oom import (
    DeviceFailed,
    ErrorKind,
    OomRecovery,
    Outcome,
    classify_error,
    unless_out_of_memory,
)
from app.engine.predictor import Prediction, Predictor, Sample
from app.engine.profiles import ModelProfile, ProfileKey, ProfileStore, device_identity
from app.engine.residency import Footprint, LoadRate, Residency, needed, plan_evictions
from app.engine.warmup import (
    NEAR_TIE,
    OutOfMemoryAtWarmup,
    WarmupProfile,
    choose_batch_size,
    profile,
)
from app.errors import (
    Conflict,
    DeadlineExceeded,
    InsufficientMemory,
    NotFound,
    NotReady,
    Overloaded,
    Paused,
)
from app.memory.allocations import LargeAllocationWatch
from app.memory.budget import Budget
from app.memory.diagnostics import IDLE_PERIOD_S, IdleFindings, MemoryDiagnostics
from app.memory.fit import MemoryFit, fit_linear
from app.memory.guard import GuardState, MemoryGuard
from app.memory.probes import CpuProbe, CudaProbe, MemoryReading, Probe, make_probe
from app.memory.trim import give_back_to_os
from app.models import LoadedModel, in_catalogue, load_model, resolve_weights
from app.models.registry import fingerprint
from app.schemas import MemoryReport, ModelMemory, ProfilePoint
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
    reused_profile: bool = False
    batch_size: AdaptiveBatchSize | None = None  # None: the size was set by hand

    @property
    def footprint(self) -> Footprint:
        return Footprint(self.memory.weights_bytes,
                         self.memory.fit.peak(max(1, self.guard.max_batch)))


@dataclass
class ModelEvents:
    """Counted per model since start, for /metrics."""

    loads: int = 0
    load_seconds: float = 0.0
    unloads: dict[str, int] = field(default_factory=dict)  # by reason
    requests: Counter[str] = field(default_factory=Counter)  # by outcome: ok, cached
    sizes: Counter[int] = field(default_factory=Counter)  # batches by size


def weights_bytes(model: LoadedModel) -> int:
    module = model.module
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


class InferenceEngine:
    """Owns the batcher, the models loaded on the device and their memory accounting;
    ``start`` must finish before ``classify``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.cpu_instead_of_gpu = cpu_fallback_reason(settings.device)
        self.phase = Phase.STARTING
        self.error: str | None = None
        # A sticky CUDA error broke the device's context: no restart of it in-process.
        self.device_lost = False
        self.runtimes: dict[str, Runtime] = {}
        self.residents: dict[str, Residency] = {}
        self.events: dict[str, ModelEvents] = {}
        self.probe: Probe | None = None
        self.budget: Budget | None = None
        self._others_at_start: int | None = None
        self.profiles = ProfileStore(settings.profile_dir)
        self._loading: dict[str, asyncio.Future[Runtime]] = {}
        self._load_rate = LoadRate(settings.max_loads_per_minute, time.monotonic)
        self._fingerprints: dict[tuple[Path, int, int], str] = {}  # weights file -> version
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
        self._wait_s = settings.max_wait_ms / 1000 if settings.max_wait_ms is not None else (
            GPU_DEFAULT_WAIT_S if self.device.type == "cuda" else 0.0)
        self._cpu_threads = CpuThreads() if self.device.type == "cpu" else None
        self.batcher: MicroBatcher[Sample, Outcome] = MicroBatcher(
            max_wait_s=self._wait_s, queue_size=settings.queue_size)

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    @property
    def runtime(self) -> Runtime | None:
        """The ``--model`` one's runtime when it is loaded, else any loaded model's: what
        the device-wide figures (memory report, metrics) are read through."""
        runtimes = dict(self.runtimes)
        return runtimes.get(self.settings.model) or next(iter(runtimes.values()), None)

    def require_runtime(self, name: str | None = None) -> Runtime:
        """The runtime of a loaded model (``name``, or the ``--model`` one, or any); NotReady
        (503) before warmup has finished or when it is not loaded."""
        if not self.ready:
            raise NotReady(self.not_ready_message(), retry_after=5)
        runtime = self.runtime if name is None else self.runtimes.get(name)
        if runtime is None:
            raise NotReady(f"The model {name or self.settings.model} is not loaded. Ask for "
                           "it in a request and vramguard loads it.", retry_after=2)
        return runtime

    def require_unpaused(self) -> None:
        """Paused (503) while an admin has paused the appliance; the route checks it before
        reading an upload, so cached answers stop too."""
        if self.paused:
            raise Paused("vramguard is paused. Resume it from the tray or with "
                         "POST /v1/admin/resume.", retry_after=30)

    def knows(self, name: str) -> bool:
        """Whether ``name`` is a model this vramguard may load (never a path)."""
        return name == self.settings.model or name in self.settings.models or in_catalogue(name)

    async def start(self) -> None:
        """Load the ``--model`` and ``--models`` ones and warm them up on the device thread;
        record any failure. Not enough memory for them is not a failure: the appliance
        serves, and each request says what it would take."""
        self.batcher.start()
        names = dict.fromkeys([self.settings.model, *self.settings.models])
        try:
            self.phase = Phase.LOADING
            for name in names:
                await self.on_device(functools.partial(self._load_on_device, name, True))
        except InsufficientMemory as exc:
            log.warning("%s", exc.message)
        except Exception as exc:
            self.phase = Phase.FAILED
            self.error = str(exc) or type(exc).__name__
            log.exception("model %s could not start", self.settings.model)
            return
        self.phase = Phase.READY
        for runtime in list(self.runtimes.values()):
            log.info("ready: %s on %s, batch size %d (%.1f images/s), %s %.1f s; "
                     "%d bytes per image, budget %d bytes", runtime.model.name, self.device,
                     runtime.guard.max_batch, runtime.warmup.throughput_at(
                         runtime.guard.max_batch),
                     "profile reused, loaded in" if runtime.reused_profile else "warmup",
                     runtime.warmup.duration_s, runtime.memory.fit.bytes_per_sample,
                     runtime.guard.budget_bytes)

    def stop(self) -> None:
        self.phase = Phase.STOPPED
        self.batcher.stop()

    async def acquire(self, name: str | None, timeout_s: float,
                      keep_alive_s: float | None = None) -> Runtime:
        """The runtime of ``name`` (default: the ``--model`` one), loading it first when it
        is a catalogue model not loaded yet; a request that asked for it waits for the load
        up to ``timeout_s``. NotFound for a name outside the catalogue."""
        name = name or self.settings.model
        if not self.knows(name):
            raise NotFound(f"There is no model called '{name}' on this computer. GET "
                           "/v1/models lists the models this vramguard can load.")
        if not self.ready:
            raise NotReady(self.not_ready_message(), retry_after=5)
        runtime = self.runtimes.get(name)
        if runtime is None:
            task = self._loading.get(name)
            if task is None:
                task = self._loading[name] = asyncio.ensure_future(self._load(name))
                task.add_done_callback(functools.partial(self._loaded, name))
            try:
                runtime = await asyncio.wait_for(asyncio.shield(task), timeout_s)
            except TimeoutError:
                raise DeadlineExceeded(f"The model {name} is still loading. Try again in a "
                                       "few seconds.", retry_after=5) from None
        resident = self.residents.get(name)
        if resident is not None:
            resident.use(time.monotonic(), keep_alive_s)
        return runtime

    @property
    def loading(self) -> set[str]:
        """Models being loaded now."""
        return set(self._loading)

    def _loaded(self, name: str, task: asyncio.Future[Runtime]) -> None:
        self._loading.pop(name, None)
        if not task.cancelled():
            task.exception()  # retrieved: the requests that waited were told

    async def _load(self, name: str) -> Runtime:
        self._load_rate.take()
        return await self.on_device(functools.partial(self._load_on_device, name, False))

    async def unload(self, name: str) -> None:
        """Unload ``name`` now (an admin's choice, pinned or not); Conflict while it has
        images waiting or in progress, NotFound when it is not loaded."""
        if name not in self.runtimes:
            raise NotFound(f"The model {name} is not loaded.")
        await self.on_device(functools.partial(self._unload_on_device, name, "admin",
                                               True))

    def admit(self, timeout_s: float, model: str | None = None) -> Reservation:
        """A place in line for an image not read yet, or Overloaded (503) at once when its
        answer could not come within ``timeout_s``: refused before its upload is read."""
        return self.batcher.reserve(timeout_s, model)

    async def classify(self, sample: Sample, timeout_s: float,
                       reservation: Reservation | None = None,
                       model: str | None = None) -> Prediction:
        """Queue one preprocessed image (in its reserved place) for at most ``timeout_s``;
        raises Overloaded / DeadlineExceeded when busy, Paused while paused."""
        runtime = self.require_runtime(model)
        self.require_unpaused()
        self._last_activity = time.monotonic()
        name = runtime.model.name
        try:
            outcome = await self.batcher.infer(sample, timeout_s, reservation, name)
        finally:
            resident = self.residents.get(name)
            if resident is not None and resident.expired(time.monotonic()):
                with contextlib.suppress(RuntimeError):  # the device thread is stopping
                    self.batcher.call(functools.partial(self._expire, name))
        if isinstance(outcome, InsufficientMemory):
            raise outcome
        return outcome

    def count(self, name: str, outcome: str) -> None:
        """One image of ``name`` answered (``ok``: computed, ``cached``), for /metrics."""
        self.events.setdefault(name, ModelEvents()).requests[outcome] += 1

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

    def load(self, name: str | None = None) -> LoadedModel:
        """Load a model on the calling thread (the server calls it on the device thread)."""
        name = name or self.settings.model
        weights = self.settings.weights if name == self.settings.model else None
        return load_model(name, self.device, weights)

    def _profile_key(self, name: str, weights_version: str) -> ProfileKey:
        device, driver = device_identity(self.device)
        return ProfileKey(name, weights_version, device, driver, torch.__version__)

    def _load_on_device(self, name: str, pinned: bool) -> Runtime:
        """Make room, load, warm up (or reuse the stored profile), check the measured fit.

        Everything runs on the device thread, so two loads never race for the same room.
        An out-of-memory during the load unloads the half-loaded model, marks its profile
        and retries once after evicting one more model."""
        if name in self.runtimes:
            return self.runtimes[name]
        started = time.monotonic()
        guess = self._guess(name)
        self._evict_for(name, guess)
        runtime = self._load_once(name, pinned, started)
        if runtime is None:
            if not self._evict_one(name):
                raise InsufficientMemory(self._no_room(name, guess))
            log.warning("ran out of memory loading %s: unloaded another model, trying once "
                        "more", name)
            runtime = self._load_once(name, pinned, started)
            if runtime is None:
                raise InsufficientMemory(self._no_room(name, guess))
        if needed(r.footprint for r in self.runtimes.values()) > self._room():
            footprint = runtime.footprint
            victims = self._victims(name, footprint)
            if victims is None:
                del runtime  # so that unloading it really frees it
                self._unload_on_device(name, "did_not_fit", False)
                raise InsufficientMemory(self._no_room(name, footprint))
            for victim in victims:
                self._unload_on_device(victim, "evicted", False)
        events = self.events.setdefault(name, ModelEvents())
        events.loads += 1
        events.load_seconds += time.monotonic() - started
        return runtime

    def _load_once(self, name: str, pinned: bool, started: float) -> Runtime | None:
        """Load and warm up ``name``; None when the device ran out of memory doing it (the
        half-loaded model is gone and its memory given back by then)."""
        try:
            return self.warm_up(self.load(name), pinned=pinned, started=started)
        except OutOfMemoryAtWarmup:
            pass
        except Exception as exc:
            if classify_error(exc) is not ErrorKind.OUT_OF_MEMORY:
                raise
        self._forget(name)
        self._mark_out_of_memory(name)
        return None

    def _guess(self, name: str) -> Footprint:
        """What ``name`` will take: its stored profile's weights and batch, else its weights
        file's size (the batch is measured once loaded). The load itself reports a file
        that cannot be found or read."""
        try:
            path = self._weights_path(name)
            stat = path.stat()
        except Exception:
            return Footprint(0, 0)
        version = self._fingerprints.get((path, stat.st_mtime_ns, stat.st_size))
        if version is None:
            version = fingerprint(path)
            self._fingerprints[(path, stat.st_mtime_ns, stat.st_size)] = version
        stored = self.profiles.get(self._profile_key(name, version))
        if stored is None or stored.out_of_memory_on_load:
            return Footprint(stat.st_size, 0)
        size = min(self.settings.batch_size or stored.chosen_batch_size, stored.points[-1][0])
        return Footprint(stored.weights_bytes, stored.footprint_peak(size))

    def _weights_path(self, name: str) -> Path:
        return resolve_weights(name, self.settings.weights if name == self.settings.model
                               else None)

    def _room(self) -> int:
        """What the models may take together now (``Budget.room``); unlimited before the
        first model has been measured."""
        budget = self.budget
        if budget is None:
            return 2**62
        return budget.room

    def _victims(self, name: str, incoming: Footprint) -> list[str] | None:
        residents = [r for n, r in self.residents.items() if n != name]
        others = [r for n, r in self.runtimes.items() if n != name]
        room = self._room()
        if needed([*(r.footprint for r in others), incoming]) <= room:
            return []
        return plan_evictions(residents, incoming, room, time.monotonic(), self._busy,
                              self.settings.min_residency_s)

    def _evict_for(self, name: str, incoming: Footprint) -> None:
        victims = self._victims(name, incoming)
        if victims is None:
            raise InsufficientMemory(self._no_room(name, incoming))
        for victim in victims:
            self._unload_on_device(victim, "evicted", False)

    def _evict_one(self, name: str) -> bool:
        """Unload the least recently used evictable model (after an OOM while loading)."""
        now = time.monotonic()
        candidates = sorted((r for n, r in self.residents.items() if n != name
                             and not r.pinned and not self._busy(n)
                             and now - r.loaded_at >= self.settings.min_residency_s),
                            key=lambda r: r.last_used)
        if not candidates:
            return False
        self._unload_on_device(candidates[0].name, "evicted", False)
        return True

    def _busy(self, name: str) -> bool:
        try:
            lane = self.batcher.lane(name)
        except KeyError:
            return False
        return lane.waiting + lane.in_flight > 0

    def _no_room(self, name: str, incoming: Footprint) -> str:
        loaded = ", ".join(f"{n} ({human_bytes(r.footprint.weights)})"
                           for n, r in self.runtimes.items() if n != name) or "none"
        need = (f"{human_bytes(incoming.weights + incoming.batch_peak)} (weights "
                f"{human_bytes(incoming.weights)} + a batch "
                f"{human_bytes(incoming.batch_peak)})" if incoming.batch_peak
                else f"at least {human_bytes(incoming.weights)} for its weights")
        return (f"There is not enough memory to load the model {name}: it needs {need}, and "
                f"vramguard may use {human_bytes(self._room())} in all. Loaded now: "
                f"{loaded}; models in use or kept loaded on purpose are not unloaded for it. "
                "Close other programs that use the graphics card, unload a model from the "
                "tray, or raise memory_budget.")

    def _forget(self, name: str) -> None:
        """After a failed load: no trace of the model, its memory given back."""
        self.runtimes.pop(name, None)
        self.residents.pop(name, None)
        gc.collect()
        if self.probe is not None:
            self.probe.empty_cache()

    def warm_up(self, model: LoadedModel, *, pinned: bool = True,
                started: float | None = None) -> Runtime:
        """Time batch sizes and measure their memory (or reuse the profile stored for this
        model, device and versions), set up the guard (before any cap applies), and install
        the runtime and its lane. Runs on the calling thread, like ``load``."""
        started = time.monotonic() if started is None else started
        predictor = Predictor(model, keep_all=self.settings.cache)
        size = weights_bytes(model)
        if self.probe is None:
            cap = int(self.settings.cpu_memory_cap) if self.settings.cpu_memory_cap else None
            self.probe = make_probe(self.device, 0, cap)
        probe = self.probe
        self._set_weights(self._weights_total() + size)
        key = self._profile_key(model.name, model.weights_version)
        stored = self.profiles.get(key)
        reused = stored is not None and not stored.out_of_memory_on_load
        try:
            if stored is not None and reused:
                warmup, points, chosen = self._reuse(predictor, probe, stored, started)
            else:
                warmup, points, chosen = self._measure(predictor, probe)
                # Measured short of memory (another program, a model not unloaded yet):
                # kept for now, but the next load measures again.
                stored = ModelProfile(key, size, fit_linear(points), points, warmup.timings,
                                      chosen, warmup.out_of_memory_at,
                                      out_of_memory_on_load=warmup.out_of_memory_at is not None)
                self.profiles.put(stored)
        except Exception as exc:
            self._set_weights(self._weights_total())
            if isinstance(exc, OutOfMemoryAtWarmup) or (
                    classify_error(exc) is ErrorKind.OUT_OF_MEMORY):
                raise OutOfMemoryAtWarmup() from None
            raise
        probe.empty_cache()
        give_back_to_os()  # warmup's largest batch would stay resident on the host
        probe.set_baseline()
        reading = probe.read()
        if self._others_at_start is None:
            self._others_at_start = reading.others
        memory = MemoryProfile(size, reading.overhead, self._others_at_start,
                               fit_linear(points), points)
        budget = self.budget = self._budget(reading, self._weights_total() + size)
        for other in list(self.runtimes.values()):
            other.guard.set_budget(budget)
        guard = MemoryGuard(budget, memory.fit, max_batch=chosen,
                            high=self.settings.high_watermark, low=self.settings.low_watermark)
        probe.set_backstop(self.settings.memory_fraction)
        probe.reset_peak()
        adaptive = None if self.settings.batch_size else AdaptiveBatchSize(
            [(t.batch_size, t.seconds) for t in warmup.timings], initial=chosen,
            max_size=max(chosen, self._ceiling(warmup, points)),
            target_latency_s=self.settings.target_latency_ms / 1000)
        runtime = Runtime(model, predictor, probe, guard,
                          OomRecovery(predictor, guard, probe), memory, warmup, reused,
                          adaptive)
        self.install(runtime, pinned=pinned)
        if stored is not None and reused:
            log.info("%s: reused the profile measured on %s for this model, device and "
                     "versions (%s)", model.name, time.strftime("%Y-%m-%d %H:%M",
                                                               time.localtime(
                                                                   stored.measured_at)),
                     self.profiles.folder / key.file_name())
            if stored.stale:
                self.batcher.call(functools.partial(self._remeasure, model.name, key))
        return runtime

    def install(self, runtime: Runtime, *, pinned: bool = True, name: str | None = None
                ) -> None:
        """Serve a warmed-up runtime: its residency, and its lane at its batch size and
        measured rate. (Tests install runtimes built around stand-in devices.)"""
        name = name or runtime.model.name
        self.probe = self.probe or runtime.probe
        self.runtimes[name] = runtime
        now = time.monotonic()
        self.residents[name] = Residency(name, runtime.footprint, now, now,
                                         -1.0 if pinned else self.settings.keep_alive_s,
                                         pinned)
        lane = self.batcher.add_lane(name, functools.partial(self._run_batch, name),
                                     max_batch=runtime.guard.max_batch,
                                     batch_limit=functools.partial(self._batch_limit, name))
        if runtime.warmup is not None:
            lane.set_service_rate(runtime.warmup.throughput_at(runtime.guard.max_batch))
        # Published before the engine says ready, so /metrics has every memory series
        # from the first scrape after /readyz answers 200.
        primary = self.runtime
        if primary is not None and primary.model is not None:
            self.last_report = self._report(primary)

    @staticmethod
    def _ceiling(warmup: WarmupProfile, points: list[tuple[int, int]]) -> int:
        """The largest batch size service may move to: measured in memory, and not past a
        size warmup timed as slower per image than the best (a CPU's cost per image rises
        with the batch, which the a + b x n line cannot represent)."""
        best = max(t.images_per_second for t in warmup.timings)
        timed = max(t.batch_size for t in warmup.timings
                    if t.images_per_second >= NEAR_TIE * best)
        return min(timed, points[-1][0])

    def _reuse(self, predictor: Predictor, probe: Probe, stored: ModelProfile,
               started: float) -> tuple[WarmupProfile, list[tuple[int, int]], int]:
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
        try:
            predictor(predictor.random_batch(chosen))
        except Exception as exc:
            if chosen == 1 or classify_error(exc) is not ErrorKind.OUT_OF_MEMORY:
                raise
            log.warning("%s: a batch of %d no longer fits in memory while loading; warming "
                        "up with one image", stored.key.model, chosen)
            probe.empty_cache()
            predictor(predictor.random_batch(1))
        return stored.warmup(time.monotonic() - started), list(stored.points), chosen

    def _measure(self, predictor: Predictor, probe: Probe
                 ) -> tuple[WarmupProfile, list[tuple[int, int]], int]:
        """Time batch sizes and measure each one's memory; the chosen size fits."""
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
        return warmup, points, chosen

    def _remeasure(self, name: str, key: ProfileKey) -> None:
        """An old profile was reused at load: measure again, between batches, for the next
        load (a machine drifts; the live figures are corrected by serving itself)."""
        runtime = self.runtimes.get(name)
        if runtime is None:
            return
        warmup, points, chosen = self._measure(runtime.predictor, runtime.probe)
        runtime.probe.empty_cache()
        self.profiles.put(ModelProfile(key, runtime.memory.weights_bytes, fit_linear(points),
                                       points, warmup.timings, chosen,
                                       warmup.out_of_memory_at))
        log.info("%s: profile measured again (the stored one was over 30 days old)", name)

    def _mark_out_of_memory(self, name: str) -> None:
        """Keep in the profile that this model ran out of memory loading (copying its
        weights or warming up, in any of the forms CUDA has): the next load measures it
        again instead of trusting figures that did not hold."""
        stamps = [(path, version) for (path, _, _), version in self._fingerprints.items()]
        for path, version in stamps:
            if path != self._weights_path(name):
                continue
            key = self._profile_key(name, version)
            stored = self.profiles.get(key)
            if stored is not None:
                stored.out_of_memory_on_load = True
                self.profiles.put(stored)

    def _weights_total(self) -> int:
        return sum(r.memory.weights_bytes for r in self.runtimes.values())

    def _set_weights(self, total: int) -> None:
        """What stays allocated for the weights of the loaded models, for the probe."""
        probe = self.probe
        if probe is None:
            return
        probe.weights = total
        if isinstance(probe, CpuProbe) and probe.tracker is not None:
            probe.tracker.base = total

    def _budget(self, reading: MemoryReading, weights: int | None = None) -> Budget:
        """The budget with ``weights`` (default: the loaded models') on the device."""
        assert self.probe is not None
        return Budget(total=reading.total, fraction=self.settings.memory_fraction,
                      weights=self._weights_total() if weights is None else weights,
                      workspaces=self.probe.workspaces,
                      overhead=reading.overhead,
                      cap=int(self.settings.memory_budget) if self.settings.memory_budget
                      else None)

    def _rebudget(self, reading: MemoryReading | None = None) -> None:
        """The loaded models changed: one budget, with their weights, for every guard."""
        probe = self.probe
        if probe is None:
            return
        self._set_weights(self._weights_total())
        if reading is None:
            probe.set_baseline()
            reading = probe.read()
        budget = self.budget = self._budget(reading)
        for runtime in list(self.runtimes.values()):
            runtime.guard.set_budget(budget)

    def _expire(self, name: str) -> None:
        resident = self.residents.get(name)
        if resident is not None and resident.expired(time.monotonic()) and not self._busy(name):
            self._unload_on_device(name, "expired", False)

    def _unload_on_device(self, name: str, reason: str, strict: bool) -> None:
        """Unload ``name``: its lane closes, its memory goes back to the device and the
        system, the budget grows by its weights. ``strict``: Conflict while it is busy."""
        if strict and self._busy(name):
            raise Conflict(f"The model {name} has images waiting or in progress; try again "
                           "when they are done.")
        runtime = self.runtimes.pop(name, None)
        self.residents.pop(name, None)
        if runtime is None:
            return
        self.batcher.remove_lane(name, Overloaded(f"The model {name} was unloaded. Try "
                                                  "again.", retry_after=1))
        del runtime
        gc.collect()
        if self.probe is not None:
            self.probe.empty_cache()
        give_back_to_os()
        self._rebudget()
        events = self.events.setdefault(name, ModelEvents())
        events.unloads[reason] = events.unloads.get(reason, 0) + 1
        log.info("unloaded %s (%s)", name, reason.replace("_", " "))
        primary = self.runtime
        if primary is not None:
            self.last_report = self._report(primary)
        elif self.last_report is not None:  # nothing loaded: the last figures, no models
            self.last_report = self.last_report.model_copy(
                update={"models": [], "weights_bytes": 0})

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

    def _batch_limit(self, name: str) -> int:
        runtime = self.runtimes.get(name)
        if runtime is None:
            return 0
        return runtime.guard.max_batch_now(runtime.probe.in_use())

    def _run_batch(self, name: str, samples: list[Sample]) -> list[Outcome]:
        runtime = self.runtimes.get(name)
        if runtime is None:
            raise RuntimeError(f"a batch of {name} ran while it was not loaded")
        if self.device_lost:  # queued before it failed: never touch the broken device again
            raise NotReady(self.not_ready_message(), retry_after=5)
        guard, probe = runtime.guard, runtime.probe
        if self._cpu_threads is not None:
            self._cpu_threads.fit(self.batcher.backlog > 0, name, len(samples))
        ooms = guard.counters.oom_events
        started = time.perf_counter()
        try:
            with self._allocations.batch(probe, len(samples),
                                         guard.profiled.peak(len(samples))):
                outcomes = runtime.recovery(samples)
        except DeviceFailed as exc:
            self.phase, self.error, self.device_lost = Phase.FAILED, str(exc), True
            raise NotReady(self.not_ready_message(), retry_after=5) from None
        self.events.setdefault(name, ModelEvents()).sizes[len(samples)] += 1
        took = time.perf_counter() - started if guard.counters.oom_events == ooms else None
        if self._cpu_threads is not None:
            self._cpu_threads.record(took)
        if runtime.batch_size is not None and took is not None:
            self._adapt(name, runtime, len(samples), took)
        measured = probe.batch_peak()
        usage = measured if measured is not None else guard.fit.peak(len(samples))
        usage = max(usage, probe.held())
        self._peak_since_tick = max(self._peak_since_tick, usage)
        if self._observe(usage) is GuardState.SHEDDING:
            probe.empty_cache()
        self._released = False
        return outcomes

    def _adapt(self, name: str, runtime: Runtime, images: int, seconds: float) -> None:
        """Feed a batch's time to the model's batch-size estimate; move its batch size
        when the estimate says so (batches split by an OOM recovery are not fed)."""
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
            resident = self.residents.get(name)
            if resident is not None:
                resident.footprint = runtime.footprint

    def _observe(self, usage: int) -> GuardState:
        """Every model's guard sees the device-wide usage; the state is the worst of them."""
        states = [r.guard.observe(usage) for r in list(self.runtimes.values())]
        order = [GuardState.OK, GuardState.HIGH, GuardState.SHEDDING]
        return max(states, key=order.index, default=GuardState.OK)

    def tick(self) -> MemoryReading | None:
        """Once a second: follow other programs' memory, update the state, unload models
        whose keep-alive has run out; once per quiet spell after work, diagnose memory and
        give the cache back."""
        runtime = self.runtime
        if runtime is None:
            return None
        probe = runtime.probe
        reading = probe.read()
        growth = reading.others - (self._others_at_start or 0)
        for each in list(self.runtimes.values()):
            each.guard.shrink_for_others(growth)
        usage, self._peak_since_tick = max(self._peak_since_tick, probe.held()), 0
        self._observe(usage)
        for name in list(self.residents):
            self._expire(name)
        runtime = self.runtime
        if runtime is None:
            return reading
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
        give_back_to_os()  # the host side too: pinned buffers, the CPU's activations
        for each in list(self.runtimes.values()):
            each.guard.relax()
        self._released = True
        return before, runtime.probe.read().reserved

    def memory_report(self) -> MemoryReport:
        """Everything /v1/memory shows; call on the device thread."""
        return self._report(self.require_runtime())

    def _report(self, runtime: Runtime) -> MemoryReport:
        probe, guard, memory = runtime.probe, runtime.guard, runtime.memory
        reading = probe.read()
        named = list(self.runtimes.items())
        runtimes = [r for _, r in named]
        counters = [r.guard.counters for r in runtimes]
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
            weights_bytes=sum(r.memory.weights_bytes for r in runtimes),
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
            oom_events=sum(c.oom_events for c in counters),
            oom_recoveries=sum(c.oom_recoveries for c in counters),
            oom_failures=sum(c.oom_failures for c in counters),
            state_changes=sum(c.state_changes for c in counters),
            idle_releases=sum(c.idle_releases for c in counters),
            cache_empties=sum(c.cache_empties for c in counters),
            fragmentation_releases=diagnostics.fragmentation_releases,
            leak_suspected=diagnostics.leak_suspected,
            leak_growth_bytes=diagnostics.leak_growth,
            idle_baselines_bytes=list(diagnostics.baselines),
            large_allocations=self._allocations.logged,
            gpu_utilization_ratio=nvml.utilization() if nvml is not None else None,
            cpu_instead_of_gpu=self.cpu_instead_of_gpu,
            models=[ModelMemory(name=n, weights_bytes=r.memory.weights_bytes,
                                batch_peak_bytes=r.footprint.batch_peak,
                                batch_size=r.guard.max_batch, pinned=self._pinned(n))
                    for n, r in named],
        )

    def _pinned(self, name: str) -> bool:
        resident = self.residents.get(name)
        return resident is not None and resident.pinned

    def reset_peak(self) -> tuple[int, int]:
        """Reset the peak figures; peak allocated bytes before/after."""
        probe = self.require_runtime().probe
        before = probe.read().peak_allocated
        probe.reset_peak()
        return before, probe.read().peak_allocated
