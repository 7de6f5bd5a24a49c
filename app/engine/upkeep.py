"""Upkeep, once a second on the device thread (``tick``): follow other programs' memory,
update the watermark state, unload models whose keep-alive has run out or whose folder was
removed or replaced, and once per quiet spell after work diagnose what is still in use,
give memory back and trace a leak; when another vramguard comes to the GPU, fit into the
smaller share.

The rules: a quiet spell is ``idle_release_s`` (else ``IDLE_PERIOD_S``) without a request,
after at least one batch since the last one and with nothing queued; the cache is given
back then when idle release is on, and whatever the setting when it is fragmented. When
this server's share shrinks, its cache is given back at once (the allocator's new limit
does not free what it already holds) and models are unloaded, by residency's one eviction
rule, until those left fit the new room: their weights and the largest batch of any.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from app.config import Settings
from app.engine.batcher import MicroBatcher
from app.engine.oom import Outcome
from app.engine.predictor import Sample
from app.engine.report import MemoryReports
from app.engine.residency import NOTHING, evictable, needed, plan_evictions
from app.engine.runtime import Clock, LoadedModels, Runtime, busy
from app.memory.diagnostics import IDLE_PERIOD_S, IdleFindings
from app.memory.history import TRACER, AllocatorHistory
from app.memory.probes import CudaProbe, MemoryReading
from app.memory.trim import give_back_to_os
from app.units import human_bytes

log = logging.getLogger("vramguard.engine")
Unload = Callable[[str, str, bool], None]  # name, reason, strict
Withdrawn = Callable[[str], bool]  # whether a loaded model has left the catalogue


class Upkeep:
    """What the memory monitor's tick does; ``unload`` is the engine's unload step and
    ``withdrawn`` says which loaded models were removed or replaced in the models folder."""

    def __init__(self, settings: Settings, models: LoadedModels,
                 batcher: MicroBatcher[Sample, Outcome], reports: MemoryReports,
                 clock: Clock, unload: Unload,
                 withdrawn: Withdrawn = lambda _: False) -> None:
        self.settings = settings
        self.models = models
        self.batcher = batcher
        self.reports = reports
        self._clock = clock
        self._unload = unload
        self._withdrawn = withdrawn
        self.last_activity = clock()
        self._peak_since_tick = 0
        self._released = True
        self._batches_at_idle = 0  # batches served when the last idle period was diagnosed
        self.history = AllocatorHistory()  # shared with the allocator-history route
        self._leak_snapshot: Path | None = None

    def touch(self) -> None:
        """A request came: the quiet spell starts again."""
        self.last_activity = self._clock()

    def note_batch(self, usage: int) -> None:
        """A batch ran using ``usage`` bytes: the tick's peak, and memory to give back."""
        self._peak_since_tick = max(self._peak_since_tick, usage)
        self._released = False

    def expire(self, name: str) -> None:
        """Unload ``name`` when its keep-alive has run out and nothing of it is queued."""
        resident = self.models.residents.get(name)
        if (resident is not None and resident.expired(self._clock())
                and not busy(self.batcher, name)):
            self._unload(name, "expired", False)

    def tick(self) -> MemoryReading | None:
        """Once a second: follow other programs' memory, update the state, unload models
        whose keep-alive has run out; once per quiet spell after work, diagnose memory and
        give the cache back."""
        models = self.models
        runtime = models.primary
        if runtime is None:
            return None
        probe = runtime.probe
        share = models.sharing.share
        if models.sharing.refresh():
            self._reshare(runtime, shrank=models.sharing.share < share)
        reading = probe.read()
        growth = models.others_now(reading) - models.others_base
        for each in list(models.runtimes.values()):
            each.guard.shrink_for_others(growth)
        usage, self._peak_since_tick = max(self._peak_since_tick, probe.in_use()), 0
        models.observe(usage)
        for name in list(models.residents):
            self.expire(name)
        for name in list(models.runtimes):
            if self._withdrawn(name) and not busy(self.batcher, name):
                self._unload(name, "removed", False)
        runtime = models.primary
        if runtime is None:
            return reading
        idle = self._clock() - self.last_activity
        batches = self.batcher.stats.batches
        if (idle >= (self.settings.idle_release_s or IDLE_PERIOD_S)
                and batches != self._batches_at_idle and self.batcher.queue_depth == 0):
            self._batches_at_idle = batches
            self._idle_period(runtime, idle)
        self.reports.last = self.reports.report(runtime)
        return reading

    def _reshare(self, runtime: Runtime, shrank: bool) -> None:
        """Another vramguard came to this GPU or left it: this one's share, budget and
        allocator limit follow, and the log says so; a smaller share is made to fit."""
        models = self.models
        models.rebudget()  # the budget and the allocator's limit, at the new share
        log.warning("%s", models.sharing.describe())
        if shrank:
            self.release(runtime)
            self._fit_room()

    def _fit_room(self) -> None:
        """Unload models, least recently used first, until the rest fit the room; those
        that may not be unloaded stay, and their batches are sized to what is left."""
        models = self.models
        residents = list(models.residents.values())
        room = models.room()

        def queued(name: str) -> bool:
            return busy(self.batcher, name)

        now, keep = self._clock(), self.settings.min_residency_s
        victims = plan_evictions(residents, NOTHING, room, now, queued, keep)
        if victims is None:
            victims = [r.name for r in evictable(residents, now, queued, keep)]
        for name in victims:
            self._unload(name, "evicted", False)
        left = [r.footprint for r in models.residents.values()]
        if needed(left) > room:
            log.warning("the models still loaded need %s (their weights and one full "
                        "batch) and this server's share leaves %s: batches will be smaller",
                        human_bytes(needed(left)), human_bytes(room))

    def _idle_period(self, runtime: Runtime, idle: float) -> None:
        """Diagnose what tensors still hold with nothing running, then give the cache back:
        always with idle release on, and whatever the setting when it is fragmented."""
        reading = runtime.probe.read()
        diagnostics = self.reports.diagnosed(reading)
        found = diagnostics.idle(self.reports.kept(reading), reading.reserved,
                                 reading.inactive_split)
        if found.fragmented or (self.settings.idle_release_s and not self._released):
            self.release(runtime)
            runtime.guard.counters.idle_releases += 1
            log.info("idle for %.0f s: cached memory given back%s", idle,
                     " (fragmented: only the wholly free part could be given back)"
                     if found.fragmented else "")
        if isinstance(runtime.probe, CudaProbe):
            self._trace_leak(found)
        if found.leak_raised:
            log.warning("possible memory leak: after each quiet spell vramguard keeps more "
                        "memory in use than after the one before, now %s more than after "
                        "warmup (levels: %s). Something keeps old work in memory; restarting "
                        "vramguard gives it back.%s", human_bytes(diagnostics.leak_growth),
                        ", ".join(human_bytes(level) for level in diagnostics.baselines),
                        f" Allocator snapshot: {self._leak_snapshot}"
                        if self._leak_snapshot else "")

    def _trace_leak(self, found: IdleFindings) -> None:
        """CUDA only. From the first rise of memory left in use until it falls back, the
        allocator keeps the Python stack of each live block (about 2 us per allocation),
        so that the snapshot written the first time a leak is suspected shows where the
        kept tensors were made; it is opened at pytorch.org/memory_viz."""
        memory = torch.cuda.memory
        recording = self.history.wanted_by(TRACER)
        if self._leak_snapshot is None and found.rising and not recording:
            self.history.want(TRACER, True)
            recording = True
        if found.leak_raised and self._leak_snapshot is None:
            path = self.settings.log_dir / time.strftime("leak-snapshot-%Y%m%d-%H%M%S.pickle")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                memory._dump_snapshot(str(path))  # type: ignore[no-untyped-call]  # no hints
                self._leak_snapshot = path
            except (OSError, RuntimeError) as exc:
                log.warning("could not write the allocator snapshot %s: %s", path, exc)
        if recording and (self._leak_snapshot is not None or not found.rising):
            self.history.want(TRACER, False)

    def release(self, runtime: Runtime) -> tuple[int, int]:
        """Empty the allocator cache and trust the profile again; bytes held before/after."""
        before = runtime.probe.read().reserved
        runtime.probe.empty_cache()
        for each in list(self.models.runtimes.values()):
            if each.predictor is not None and each.predictor.staging is not None:
                each.predictor.staging.release()
        give_back_to_os()  # the host side too: pinned buffers, the CPU's activations
        for each in list(self.models.runtimes.values()):
            each.guard.relax()
        self._released = True
        return before, runtime.probe.read().reserved
