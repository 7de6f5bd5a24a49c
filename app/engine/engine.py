"""The inference engine's front: what the event loop calls (``start``, ``acquire``,
``admit``, ``classify``, ``on_device``, ``view``...), composed from the engine's parts.

One device thread (the batcher's) is the only one that touches the GPU: loading, warmup,
every batch and every ``on_device`` call run there; the event loop only awaits futures.
Several models share the device: the ``--model`` one (and ``--models``) load at start and
stay; any other catalogue model loads when a request asks for it and unloads after its
keep-alive. Each model has its own lane in the batcher, and the lanes take turns.

The parts, one job each: ``runtime`` (the loaded models and their budget), ``loading``
(loading and eviction), ``calibration`` (warmup or the stored profile), ``batch_run``
(one batch), ``upkeep`` (the monitor's tick), ``report`` (the memory report), ``view``
(what readers see). Its own parts are passed in with defaults, the way Ollama's scheduler
takes ``loadFn``: the probe factory, the model loader and the clock, so tests and the CUDA
stand-in swap them without patching.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from app.config import Settings
from app.engine.batch_run import BatchRun
from app.engine.batcher import MicroBatcher
from app.engine.calibration import Calibration
from app.engine.cpu_threads import CpuThreads
from app.engine.device import cpu_fallback_reason, resolve_device
from app.engine.lanes import Reservation
from app.engine.loading import Loading, LoadSteps
from app.engine.oom import ErrorKind, Outcome, classify_error, first_line
from app.engine.predictor import Prediction, Sample
from app.engine.profiles import ProfileKey, ProfileStore
from app.engine.profiling import BackgroundProfiles
from app.engine.report import MemoryReports
from app.engine.residency import Footprint, LoadRate, Residency
from app.engine.runtime import (
    Clock,
    Health,
    LoadedModels,
    MemoryCost,
    ModelOutcomes,
    Phase,
    ProbeFactory,
    Runtime,
    not_loaded,
    paused_error,
    still_loading,
    unknown_model,
    weights_bytes,
)
from app.engine.upkeep import Upkeep
from app.engine.view import EngineView, build_view
from app.errors import InsufficientMemory, NotFound
from app.memory.allocations import LargeAllocationWatch
from app.memory.probes import MemoryReading, Probe, make_probe
from app.memory.sharing import SharingFactory, gpu_sharing
from app.models import LoadedModel
from app.models.own.store import OwnModels
from app.models.precision import choose
from app.models.sources import ModelSources, is_builtin
from app.schemas import MemoryReport
from app.units import human_bytes

__all__ = ["InferenceEngine", "MemoryCost", "ModelOutcomes", "Phase", "Runtime",
           "weights_bytes"]
log = logging.getLogger("vramguard.engine")
GPU_DEFAULT_WAIT_S = 0.002
HOST = torch.device("cpu")  # where a model is built, before it moves to the device
ModelLoader = Callable[[str, torch.device, Path | None], LoadedModel]  # name, device, file
T = TypeVar("T")


class InferenceEngine:
    """Owns the batcher, the models loaded on the device and their memory accounting;
    ``start`` must finish before ``classify``."""

    def __init__(self, settings: Settings, *, probe_factory: ProbeFactory = make_probe,
                 model_loader: ModelLoader | None = None, clock: Clock = time.monotonic,
                 sources: ModelSources | None = None,
                 sharing: SharingFactory = gpu_sharing) -> None:
        self.settings = settings
        self.sources = sources or ModelSources(OwnModels(
            settings.models_dir, timeout_s=settings.model_check_timeout_s, reserved=is_builtin))
        self.device = resolve_device(settings.device)
        self.cpu_instead_of_gpu = cpu_fallback_reason(settings.device)
        self.health = Health()
        self.paused = False
        self._clock = clock
        self._model_loader = model_loader or self.sources.load
        self._loading: dict[str, asyncio.Future[Runtime]] = {}
        self._load_rate = LoadRate(settings.max_loads_per_minute, clock,
                                   settings.max_loads_per_client_per_minute)
        wait_s = settings.max_wait_ms / 1000 if settings.max_wait_ms is not None else (
            GPU_DEFAULT_WAIT_S if self.device.type == "cuda" else 0.0)
        self.batcher: MicroBatcher[Sample, Outcome] = MicroBatcher(
            max_wait_s=wait_s, queue_size=settings.queue_size)
        self.models = LoadedModels(settings, self.device, probe_factory, sharing)
        self.profiles = ProfileStore(settings.profile_dir)
        self.calibration = Calibration(settings, self.models, self.profiles, clock,
                                       self.sources.weights_path, self.sources.format_of)
        allocations = LargeAllocationWatch(int(settings.large_allocation_bytes))
        self.reports = MemoryReports(self.models, allocations, self.cpu_instead_of_gpu)
        # Each step looked up at each call: a test or the GPU check may wrap it.
        steps = LoadSteps(load=lambda name: self.load(name),
                          warm_up=lambda model, pinned, started, first_only: self.warm_up(
                              model, pinned=pinned, started=started, first_only=first_only),
                          unload=lambda name, reason, strict: self._unload_on_device(
                              name, reason, strict))
        self.upkeep = Upkeep(settings, self.models, self.batcher, self.reports, clock,
                             steps.unload, self.sources.withdrawn)
        self.batches = BatchRun(self.models, self.batcher, self.health, allocations,
                                CpuThreads() if self.device.type == "cpu" else None,
                                self.upkeep.note_batch)
        self.loader = Loading(settings, self.models, self.batcher, self.calibration,
                              self.batches, self.reports, clock, steps)
        self.profiling = BackgroundProfiles(self.models, self.batcher, self.calibration,
                                            self._for_measuring)
        self.loader.on_unload = self.profiling.cancel

    # -- what readers see ------------------------------------------------------------------

    def view(self) -> EngineView:
        """Every figure the routes, the live samples and /metrics show, at this moment."""
        return build_view(self.health, self.paused, self.models, frozenset(self._loading),
                          self.batcher, self.reports.last, self._clock())

    @property
    def phase(self) -> Phase:
        return self.health.phase

    @phase.setter
    def phase(self, phase: Phase) -> None:
        self.health.phase = phase

    @property
    def error(self) -> str | None:
        return self.health.error

    @property
    def ready(self) -> bool:
        return self.health.ready

    @property
    def last_report(self) -> MemoryReport | None:
        """The last memory report (taken at each tick, load and unload)."""
        return self.reports.last

    @last_report.setter
    def last_report(self, report: MemoryReport | None) -> None:
        self.reports.last = report

    @property
    def runtimes(self) -> dict[str, Runtime]:
        return self.models.runtimes

    @property
    def residents(self) -> dict[str, Residency]:
        return self.models.residents

    @property
    def outcomes(self) -> dict[str, ModelOutcomes]:
        return self.models.outcomes

    @property
    def probe(self) -> Probe | None:
        return self.models.probe

    @property
    def runtime(self) -> Runtime | None:
        """The ``--model`` one's runtime when it is loaded, else any loaded model's."""
        return self.models.primary

    def not_ready_message(self) -> str:
        return self.health.not_ready_message()

    # -- what the event loop calls ---------------------------------------------------------

    def require_runtime(self, name: str | None = None) -> Runtime:
        """The runtime of a loaded model (``name``, or the ``--model`` one, or any); NotReady
        (503) before warmup has finished or when it is not loaded."""
        if not self.ready:
            raise self.health.not_ready()
        runtime = self.runtime if name is None else self.runtimes.get(name)
        if runtime is None:
            raise not_loaded(name or self.settings.model)
        return runtime

    def require_unpaused(self) -> None:
        """Paused (503) while an admin has paused the appliance; the route checks it before
        reading an upload, so cached answers stop too."""
        if self.paused:
            raise paused_error()

    def knows(self, name: str) -> bool:
        """Whether ``name`` is a model this vramguard may load (never a path)."""
        return name in (self.settings.model, *self.settings.models) or self.sources.knows(name)

    async def start(self) -> None:
        """Load the ``--model`` and ``--models`` ones and warm them up on the device thread;
        record any failure. Not enough memory for them is not a failure: the appliance
        serves, and each request says what it would take."""
        self.batcher.start()
        names = dict.fromkeys([self.settings.model, *self.settings.models])
        try:
            self.phase = Phase.LOADING
            for name in names:
                await asyncio.to_thread(self.sources.check, name)  # off loop and device
                await self.on_device(functools.partial(self.loader.load, name, True))
        except InsufficientMemory as exc:
            log.warning("%s", exc.message)
        except Exception as exc:
            self.health.phase = Phase.FAILED
            self.health.error = str(exc) or type(exc).__name__
            log.exception("model %s could not start", self.settings.model)
            return
        self.phase = Phase.READY
        for runtime in list(self.runtimes.values()):
            guard = runtime.guard
            log.info("ready: %s on %s, batch size %d (%.1f images/s), %s %.1f s; "
                     "memory per image %s, room for images %s of the %s limit",
                     runtime.model.name, self.device, guard.max_batch,
                     runtime.warmup.throughput_at(guard.max_batch),
                     "profile reused, loaded in" if runtime.reused_profile else "warmup",
                     runtime.warmup.duration_s, human_bytes(runtime.memory.fit.bytes_per_sample),
                     human_bytes(guard.budget_bytes), human_bytes(guard.budget.room))

    def stop(self) -> None:
        self.phase = Phase.STOPPED
        self.batcher.stop()
        self.models.sharing.release()  # the other vramguards on the GPU may plan for more

    async def acquire(self, name: str | None, timeout_s: float, keep_alive_s: float | None = None,
                      client: str | None = None) -> Runtime:
        """The runtime of ``name`` (default: the ``--model`` one), loading it first when it
        is a catalogue model not loaded yet (the load charged to ``client``); a request
        waits for the load up to ``timeout_s``, then Loading (503, with the seconds it is
        expected to take still). NotFound for a name outside the catalogue."""
        name = name or self.settings.model
        if not self.knows(name):
            raise unknown_model(name)
        if not self.ready:
            raise self.health.not_ready()
        runtime = self.runtimes.get(name)
        if runtime is None:
            task = self._loading.get(name)
            if task is None:
                task = self._loading[name] = asyncio.ensure_future(self._load(name, client))
                task.add_done_callback(functools.partial(self._loaded, name))
            try:
                runtime = await asyncio.wait_for(asyncio.shield(task), timeout_s)
            except TimeoutError:
                raise still_loading(name, self.loader.times.seconds_left(name)) from None
        resident = self.residents.get(name)
        if resident is not None:
            resident.use(self._clock(), keep_alive_s)
        return runtime

    def _loaded(self, name: str, task: asyncio.Future[Runtime]) -> None:
        self._loading.pop(name, None)
        if not task.cancelled():
            task.exception()  # retrieved: the requests that waited were told

    async def _load(self, name: str, client: str | None) -> Runtime:
        self._load_rate.take(client)
        await asyncio.to_thread(self.sources.check, name)  # off loop and device
        return await self.on_device(functools.partial(self.loader.load, name, False, True))

    async def unload(self, name: str) -> None:
        """Unload ``name`` now (an admin's choice, pinned or not); Conflict while it has
        images waiting or in progress, NotFound when it is not loaded."""
        if name not in self.runtimes:
            raise NotFound(f"The model {name} is not loaded.")
        await self.on_device(functools.partial(self._unload_on_device, name, "admin", True))

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
        self.upkeep.touch()
        name = runtime.model.name
        try:
            outcome = await self.batcher.infer(sample, timeout_s, reservation, name)
        finally:
            resident = self.residents.get(name)
            if resident is not None and resident.expired(self._clock()):
                with contextlib.suppress(RuntimeError):  # the device thread is stopping
                    self.batcher.call(functools.partial(self.upkeep.expire, name))
        if isinstance(outcome, InsufficientMemory):
            raise outcome
        return outcome

    def count(self, name: str, outcome: str) -> None:
        """One image of ``name`` answered (``ok``: computed, ``cached``), for /metrics."""
        self.models.counted(name).requests[outcome] += 1

    async def on_device(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the device thread and await it."""
        return await asyncio.wrap_future(self.batcher.call(fn))

    # -- the steps, on the device thread (wrapped by tests and the GPU check) --------------

    def load(self, name: str | None = None) -> LoadedModel:
        """Load a model on the calling thread (the server calls it on the device thread).
        It is built on the CPU and converted to its precision there, then moved: the
        device never holds an fp32 copy of weights it keeps in bf16 or fp16."""
        name = name or self.settings.model
        weights = self.settings.weights if name == self.settings.model else None
        model = self._model_loader(name, HOST, weights)
        settings = self.settings
        numerics = choose(settings.precision, settings.channels_last, self.device,
                          model.family, name)
        if numerics != model.numerics:
            numerics.module(model.module)
            log.info("%s runs in %s", name, numerics.label)
        if self.device != model.device:
            model.module.to(self.device)
        return dataclasses.replace(model, numerics=numerics, device=self.device)

    def warm_up(self, model: LoadedModel, *, pinned: bool = True,
                started: float | None = None, first_only: bool = False) -> Runtime:
        """Calibrate ``model`` (measure, or reuse its stored profile) and install it; a
        stale profile reused is measured again after, between batches. ``first_only``:
        measure batch size 1 now, the other sizes in the background."""
        started = self._clock() if started is None else started
        if first_only:
            self._for_measuring()
        runtime, reused = self.calibration.runtime_for(model, started, first_only)
        self.install(runtime, pinned=pinned)
        if not runtime.profile_complete:
            self.profiling.start(model.name)
        if reused is not None and reused.stale:
            self.batcher.call(functools.partial(self.calibration.remeasure, model.name,
                                                reused.key))
        return runtime

    def install(self, runtime: Runtime, *, pinned: bool = True, name: str | None = None
                ) -> None:
        """Serve a warmed-up runtime. (Tests install runtimes around stand-in devices.)"""
        self.loader.install(runtime, pinned, name)

    def _for_measuring(self) -> None:
        """The CPU's threads for measuring while the appliance serves."""
        if self.batches.cpu_threads is not None:
            self.batches.cpu_threads.for_measuring_while_serving()

    def _unload_on_device(self, name: str, reason: str, strict: bool) -> None:
        """Unload ``name`` (the step every eviction, expiry and admin unload takes)."""
        self.loader.unload(name, reason, strict)

    def _guess(self, name: str) -> Footprint:
        """What ``name`` will take before it loads (the GPU check compares it)."""
        return self.calibration.guess(name)

    def _profile_key(self, name: str, weights_version: str) -> ProfileKey:
        """The stored profile's key for ``name`` (the GPU check reads the profile)."""
        return self.calibration.profile_key(name, weights_version)

    def tick(self) -> MemoryReading | None:
        """The memory monitor's once a second (see ``app.engine.upkeep``). A sticky CUDA
        error here (``mem_get_info``, the synchronize in ``empty_cache``) fails the engine
        as one in a batch does: /readyz must not say ready over a broken GPU."""
        try:
            return self.upkeep.tick()
        except Exception as exc:
            if classify_error(exc) is not ErrorKind.DEVICE_LOST:
                raise
            log.exception("the GPU failed in the memory monitor")
            self.health.device_failed(first_line(exc))
            return None

    def release(self) -> tuple[int, int]:
        """Empty the allocator cache and trust the profile again; bytes held before/after."""
        return self.upkeep.release(self.require_runtime())

    def memory_report(self) -> MemoryReport:
        """Everything /v1/memory shows; call on the device thread."""
        return self.reports.report(self.require_runtime())

    def reset_peak(self) -> tuple[int, int]:
        """Reset the peak figures; peak allocated bytes before/after."""
        probe = self.require_runtime().probe
        before = probe.read().peak_allocated
        probe.reset_peak()
        return before, probe.read().peak_allocated
