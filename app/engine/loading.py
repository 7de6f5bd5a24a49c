"""Loading and eviction, whole on the device thread, so two loads never race for the same
room: predict the footprint, evict, load, warm up, check the measured fit, evict more or
unload it again.

The one eviction rule is ``residency``'s (``plan_evictions``, ``evictable``): least
recently used first, never a pinned model, a busy one or one loaded less than
``min_residency_s`` ago. The steps (``load``, ``warm_up``, ``unload``) are passed in and
looked up at each call, so a test or the GPU check can wrap them (Ollama's ``loadFn``).
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass

from app.config import Settings
from app.engine.batch_run import BatchRun
from app.engine.batcher import MicroBatcher
from app.engine.calibration import Calibration
from app.engine.load_times import LoadTimes
from app.engine.oom import ErrorKind, Outcome, classify_error
from app.engine.predictor import Sample
from app.engine.report import MemoryReports
from app.engine.residency import Footprint, Residency, evictable, needed, plan_evictions
from app.engine.runtime import Clock, LoadedModels, Runtime, busy
from app.engine.warmup import OutOfMemoryAtWarmup
from app.errors import Conflict, InsufficientMemory, Overloaded
from app.memory.trim import give_back_to_os
from app.models import LoadedModel
from app.units import human_bytes

log = logging.getLogger("vramguard.engine")


@dataclass(frozen=True)
class LoadSteps:
    """The steps a load is made of: build the model, warm it up (and install it), unload
    one (name, reason, strict)."""

    load: Callable[[str], LoadedModel]
    warm_up: Callable[[LoadedModel, bool, float, bool], Runtime]  # model, pinned, started,
    # first_only (measure batch size 1 only, the rest between batches)
    unload: Callable[[str, str, bool], None]


class Loading:
    """Loads models into room made by eviction, installs and unloads them."""

    def __init__(self, settings: Settings, models: LoadedModels,
                 batcher: MicroBatcher[Sample, Outcome], calibration: Calibration,
                 batches: BatchRun, reports: MemoryReports, clock: Clock,
                 steps: LoadSteps) -> None:
        self.settings = settings
        self.models = models
        self.batcher = batcher
        self.calibration = calibration
        self.batches = batches
        self.reports = reports
        self._clock = clock
        self.steps = steps
        self.times = LoadTimes(clock)
        self.on_unload: Callable[[str], None] = lambda name: None  # before memory is freed

    def load(self, name: str, pinned: bool, first_only: bool = False) -> Runtime:
        """Make room, load, warm up (or reuse the stored profile), check the measured fit;
        ``first_only``: measure batch size 1 only (a load while serving), the rest later.

        An out-of-memory during the load unloads the half-loaded model, marks its profile
        and retries once after evicting one more model."""
        runtimes = self.models.runtimes
        if name in runtimes:
            return runtimes[name]
        guess = self.calibration.guess(name)
        self.times.began(name, guess.weights, first_only)
        ok = False
        try:
            runtime = self._load(name, pinned, first_only, guess)
            ok = True
        finally:
            self.times.ended(name, guess.weights, first_only, ok)
        return runtime

    def _load(self, name: str, pinned: bool, first_only: bool, guess: Footprint) -> Runtime:
        started = self._clock()
        self._evict_for(name, guess)
        runtime = self._load_once(name, pinned, started, first_only)
        if runtime is None:
            if not self._evict_one(name):
                raise InsufficientMemory(self._no_room(name, guess))
            log.warning("ran out of memory loading %s: unloaded another model, trying once "
                        "more", name)
            runtime = self._load_once(name, pinned, started, first_only)
            if runtime is None:
                raise InsufficientMemory(self._no_room(name, guess))
        if needed(r.footprint for r in self.models.runtimes.values()) > self.models.room():
            footprint = runtime.footprint
            victims = self._victims(name, footprint)
            if victims is None:
                del runtime  # so that unloading it really frees it
                self.steps.unload(name, "did_not_fit", False)
                raise InsufficientMemory(self._no_room(name, footprint))
            for victim in victims:
                self.steps.unload(victim, "evicted", False)
        events = self.models.counted(name)
        events.loads += 1
        took = self._clock() - started
        events.load_seconds += took
        log.info("%s loaded in %.1f s%s", name, took, "" if runtime.profile_complete else
                 " (batch size 1 measured; the others are measured between batches)")
        return runtime

    def _load_once(self, name: str, pinned: bool, started: float, first_only: bool
                   ) -> Runtime | None:
        """Load and warm up ``name``; None when the device ran out of memory doing it (the
        half-loaded model is gone and its memory given back by then)."""
        try:
            return self.steps.warm_up(self.steps.load(name), pinned, started, first_only)
        except OutOfMemoryAtWarmup:
            pass
        except Exception as exc:
            if classify_error(exc) is not ErrorKind.OUT_OF_MEMORY:
                raise
        self._forget(name)
        self.calibration.mark_out_of_memory(name)
        return None

    def _busy(self, name: str) -> bool:
        return busy(self.batcher, name)

    def _victims(self, name: str, incoming: Footprint) -> list[str] | None:
        models = self.models
        residents = [r for n, r in models.residents.items() if n != name]
        others = [r for n, r in models.runtimes.items() if n != name]
        room = models.room()
        if needed([*(r.footprint for r in others), incoming]) <= room:
            return []
        return plan_evictions(residents, incoming, room, self._clock(), self._busy,
                              self.settings.min_residency_s)

    def _evict_for(self, name: str, incoming: Footprint) -> None:
        victims = self._victims(name, incoming)
        if victims is None:
            raise InsufficientMemory(self._no_room(name, incoming))
        for victim in victims:
            self.steps.unload(victim, "evicted", False)

    def _evict_one(self, name: str) -> bool:
        """Unload the least recently used evictable model (after an OOM while loading)."""
        others = [r for n, r in self.models.residents.items() if n != name]
        candidates = evictable(others, self._clock(), self._busy,
                               self.settings.min_residency_s)
        if not candidates:
            return False
        self.steps.unload(candidates[0].name, "evicted", False)
        return True

    def _no_room(self, name: str, incoming: Footprint) -> str:
        loaded = ", ".join(f"{n} ({human_bytes(r.footprint.weights)})"
                           for n, r in self.models.runtimes.items() if n != name) or "none"
        need = (f"{human_bytes(incoming.weights + incoming.batch_peak)} (weights "
                f"{human_bytes(incoming.weights)} + a batch "
                f"{human_bytes(incoming.batch_peak)})" if incoming.batch_peak
                else f"at least {human_bytes(incoming.weights)} for its weights")
        return (f"There is not enough memory to load the model {name}: it needs {need}, and "
                f"vramguard may use {human_bytes(self.models.room())} in all. Loaded now: "
                f"{loaded}; models in use or kept loaded on purpose are not unloaded for it. "
                "Close other programs that use the graphics card, unload a model from the "
                "tray, or raise memory_budget.")

    def _forget(self, name: str) -> None:
        """After a failed load: no trace of the model, its memory given back."""
        self.models.runtimes.pop(name, None)
        self.models.residents.pop(name, None)
        gc.collect()
        if self.models.probe is not None:
            self.models.probe.empty_cache()

    def install(self, runtime: Runtime, pinned: bool, name: str | None) -> None:
        """Serve a warmed-up runtime: its residency, and its lane at its batch size and
        measured rate; then the memory report with it."""
        models = self.models
        name = name or runtime.model.name
        models.probe = models.probe or runtime.probe
        models.runtimes[name] = runtime
        now = self._clock()
        models.residents[name] = Residency(name, runtime.footprint, now, now,
                                           -1.0 if pinned else self.settings.keep_alive_s,
                                           pinned)
        lane = self.batcher.add_lane(name, functools.partial(self.batches.run, name),
                                     max_batch=runtime.guard.max_batch,
                                     batch_limit=functools.partial(self.batches.limit, name))
        if runtime.warmup is not None:
            lane.set_service_rate(runtime.warmup.throughput_at(runtime.guard.max_batch))
        self.reports.publish()

    def unload(self, name: str, reason: str, strict: bool) -> None:
        """Unload ``name``: its lane closes, its memory goes back to the device and the
        system, the budget grows by its weights. ``strict``: Conflict while it is busy."""
        if strict and self._busy(name):
            raise Conflict(f"The model {name} has images waiting or in progress; try again "
                           "when they are done.")
        models = self.models
        runtime = models.runtimes.pop(name, None)
        models.residents.pop(name, None)
        if runtime is None:
            return
        self.batcher.remove_lane(name, Overloaded(f"The model {name} was unloaded. Try "
                                                  "again.", retry_after=1))
        self.on_unload(name)
        del runtime
        gc.collect()
        if models.probe is not None:
            models.probe.empty_cache()
        give_back_to_os()
        models.rebudget()
        events = models.counted(name)
        events.unloads[reason] = events.unloads.get(reason, 0) + 1
        log.info("unloaded %s (%s)", name, reason.replace("_", " "))
        self.reports.after_unload()
