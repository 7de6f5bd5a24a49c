"""The rest of a profile, measured in the background after a load that measured batch size
1 only (``Calibration.runtime_for(first_only=True)``: a load made while the appliance
serves, so that the request that asked for the model is answered within its deadline).

The rules: one forward pass per step, each queued with ``batcher.when_idle``, so loads and
batches go first and a steady stream of batches is delayed by one pass per batch. Until
the last step the model serves with what its load measured: one image per batch, since the
memory guard never assumes that a size not measured fits. At the last step the runtime in
force takes the whole measurement (memory fit, timings, batch size, the adaptive size, the
lane's size and rate) and the profile is stored for the next load; the batch size is
capped so that the loaded models still fit together. A model unloaded meanwhile ends the
measurement; so does an out-of-memory or any other failure (logged), and the model serves
on with what its load measured.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

from app.engine.batcher import MicroBatcher
from app.engine.calibration import Calibration, Measured
from app.engine.oom import Outcome
from app.engine.predictor import Sample
from app.engine.residency import Footprint, needed
from app.engine.runtime import LoadedModels, MemoryCost, Runtime
from app.engine.warmup import Steps
from app.memory.fit import fit_linear
from app.memory.trim import give_back_to_os

log = logging.getLogger("vramguard.engine")


class BackgroundProfiles:
    """Measures the rest of partly profiled models, a pass at a time between batches.
    ``before_step`` runs before each pass (the CPU's thread count for measuring)."""

    def __init__(self, models: LoadedModels, batcher: MicroBatcher[Sample, Outcome],
                 calibration: Calibration, before_step: Callable[[], None]) -> None:
        self.models = models
        self.batcher = batcher
        self.calibration = calibration
        self.before_step = before_step
        self._pending: dict[str, tuple[Runtime, Steps[Measured]]] = {}

    def start(self, name: str) -> None:
        """Measure the rest of ``name``'s profile (loaded with batch size 1 measured)."""
        runtime = self.models.runtimes[name]
        self.cancel(name)
        self._pending[name] = (runtime, self.calibration.measure_steps(runtime.predictor,
                                                                       runtime.probe))
        self._next(name)

    def cancel(self, name: str) -> None:
        """Stop measuring ``name`` (it is being unloaded): the queued step then finds
        nothing, and holds no reference that would keep the model's memory."""
        pending = self._pending.pop(name, None)
        if pending is not None:
            pending[1].close()

    def _next(self, name: str) -> None:
        try:
            self.batcher.when_idle(functools.partial(self._step, name))
        except RuntimeError:  # the device thread is stopping
            self.cancel(name)

    def _step(self, name: str) -> None:
        pending = self._pending.get(name)
        if pending is None:  # cancelled: unloaded since
            return
        runtime, steps = pending
        if self.models.runtimes.get(name) is not runtime:  # replaced since
            self.cancel(name)
            return
        self.before_step()
        try:
            next(steps)
        except StopIteration as done:
            del self._pending[name]
            self._complete(name, runtime, done.value)
            return
        except Exception as exc:
            del self._pending[name]
            runtime.probe.empty_cache()
            log.warning("%s: measuring the batch sizes beyond 1 stopped (%s); it goes on "
                        "serving one image per batch", name, str(exc).splitlines()[0]
                        if str(exc) else type(exc).__name__)
            return
        self._next(name)

    def _complete(self, name: str, runtime: Runtime, measured: Measured) -> None:
        """The whole measurement in force for ``name``, and stored."""
        warmup, points, chosen = measured
        runtime.probe.empty_cache()
        give_back_to_os()  # the largest batch measured would stay resident on the host
        model, memory = runtime.model, runtime.memory
        self.calibration.store(self.calibration.profile_key(model.name, model.weights_version),
                               memory.weights_bytes, warmup, points, chosen)
        fit = fit_linear(points)
        others = [r.footprint for n, r in self.models.runtimes.items() if n != name]
        sizes = [size for size, _ in points if size <= chosen]
        room = self.models.room()
        while len(sizes) > 1 and needed(
                [*others, Footprint(memory.weights_bytes, fit.peak(sizes[-1]))]) > room:
            sizes.pop()
        size = sizes[-1] if sizes else 1
        done = dataclasses.replace(
            runtime, memory=MemoryCost(memory.weights_bytes, memory.overhead_bytes,
                                       memory.others_at_start, fit, points),
            warmup=warmup, batch_size=self.calibration.adaptive(warmup, points, size),
            profile_complete=True)
        runtime.guard.reprofile(fit, size)
        self.models.runtimes[name] = done
        resident = self.models.residents.get(name)
        if resident is not None:
            resident.footprint = done.footprint
        self.batcher.set_max_batch(size, name)
        self.batcher.set_service_rate(warmup.throughput_at(size), name)
        log.info("%s: batch sizes measured in the background; batch size %d (%.1f images/s)",
                 name, size, warmup.throughput_at(size))
