"""The engine's read view: plain frozen values for everything the routes, the live samples
and ``/metrics`` show, built in one place (``engine.view()``) from the runtimes, the
batcher and the last memory report.

The rule: no reader outside ``app/engine`` reaches into ``Runtime`` or the batcher for a
figure; a field renamed inside the engine changes ``build_view`` only. Built on the event
loop from copies, it never touches the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from app.engine.batcher import MicroBatcher
from app.engine.oom import Outcome
from app.engine.predictor import Sample
from app.engine.runtime import Health, LoadedModels, Phase, Runtime, not_loaded, paused_error
from app.engine.warmup import BatchTiming
from app.errors import NotReady
from app.schemas import MemoryReport


@dataclass(frozen=True)
class BatchFit:
    """The batch time line service has fitted: ``a + b x images`` seconds."""

    a_s: float
    b_s: float
    observations: int


@dataclass(frozen=True)
class ModelFigures:
    """One loaded model: what it is, what it costs, how it is served and kept."""

    name: str
    device: str
    weights_file: str
    weights_version: str
    crop: int
    classes: int
    features: int
    task: str  # "classify", "multilabel" or "embed"
    channels: int  # of its input: 3, or 1 for a grey model
    weights_bytes: int
    fixed_bytes: int
    bytes_per_sample: int
    max_batch: int
    images_per_second: float  # by the fitted line at max_batch, else warmup's timing
    batch_fit: BatchFit | None  # None: the batch size was set by hand
    profile_reused: bool
    profile_complete: bool  # False: batch size 1 measured, the rest in the background
    warmup_seconds: float
    warmup: tuple[BatchTiming, ...]
    pinned: bool
    keep_alive_s: float | None
    expires_in_s: float | None


@dataclass(frozen=True)
class ModelCounts:
    """Counted per model since start; they outlive the model's unloading."""

    loads: int
    load_seconds: float
    unloads: Mapping[str, int]  # by reason
    requests: Mapping[str, int]  # by outcome: ok, cached
    batch_sizes: Mapping[int, int]  # batches by size


@dataclass(frozen=True)
class QueueFigures:
    """The batcher's line and counters, every lane together."""

    queue_depth: int
    in_flight: int
    batches: int
    batched_images: int
    mean_batch_size: float
    largest_batch: int
    expired: int
    withdrawn: int
    batch_sizes: Mapping[int, int]  # batches by size
    lanes: Mapping[str, int]  # each lane's batch size in force


@dataclass(frozen=True)
class EngineView:
    """Everything readers see of the engine, at one moment."""

    phase: Phase
    ready: bool
    paused: bool
    not_ready_message: str
    primary: str  # the --model one's name
    models: Mapping[str, ModelFigures]  # the loaded ones
    loading: frozenset[str]
    counts: Mapping[str, ModelCounts]
    queue: QueueFigures
    memory: MemoryReport | None  # the last memory report
    warmup_duration_s: float | None  # the primary runtime's (--model's, else any)

    def loaded(self, name: str | None = None) -> ModelFigures:
        """A loaded model's figures (``name``, or the --model one); NotReady (503) before
        warmup has finished or when it is not loaded, as ``engine.require_runtime``."""
        if not self.ready:
            raise NotReady(self.not_ready_message, retry_after=5)
        figures = self.models.get(name or self.primary)
        if figures is None:
            raise not_loaded(name or self.primary)
        return figures

    def require_unpaused(self) -> None:
        """Paused (503) while an admin has paused the appliance."""
        if self.paused:
            raise paused_error()


def queue_figures(batcher: MicroBatcher[Sample, Outcome]) -> QueueFigures:
    stats = batcher.stats
    return QueueFigures(
        queue_depth=batcher.queue_depth, in_flight=batcher.in_flight, batches=stats.batches,
        batched_images=stats.items, mean_batch_size=stats.mean_batch_size,
        largest_batch=stats.largest_batch, expired=stats.expired, withdrawn=stats.cancelled,
        batch_sizes=dict(stats.sizes),
        lanes={lane.name: lane.max_batch for lane in batcher.lanes})


def model_figures(name: str, runtime: Runtime, models: LoadedModels, now: float
                  ) -> ModelFigures:
    loaded, warmup, guard = runtime.model, runtime.warmup, runtime.guard
    resident = models.residents.get(name)
    size = guard.max_batch
    adaptive = runtime.batch_size
    line = adaptive.fit.line if adaptive is not None else None
    return ModelFigures(
        name=name, device=str(loaded.device), weights_file=str(loaded.weights_file),
        weights_version=loaded.weights_version, crop=loaded.preprocessing.crop,
        classes=loaded.num_classes, features=loaded.feature_dim, task=loaded.task,
        channels=loaded.preprocessing.channels,
        weights_bytes=runtime.memory.weights_bytes, fixed_bytes=guard.fit.fixed_bytes,
        bytes_per_sample=guard.fit.bytes_per_sample, max_batch=size,
        images_per_second=size / line.seconds(size) if line is not None
        else warmup.throughput_at(size),
        batch_fit=None if adaptive is None or line is None
        else BatchFit(line.a, line.b, adaptive.fit.observations),
        profile_reused=runtime.reused_profile, profile_complete=runtime.profile_complete,
        warmup_seconds=warmup.duration_s,
        warmup=tuple(warmup.timings), pinned=bool(resident and resident.pinned),
        keep_alive_s=None if resident is None else resident.keep_alive_s,
        expires_in_s=None if resident is None else resident.expires_in(now))


def build_view(health: Health, paused: bool, models: LoadedModels, loading: frozenset[str],
               batcher: MicroBatcher[Sample, Outcome], memory: MemoryReport | None,
               now: float) -> EngineView:
    runtimes = dict(models.runtimes)
    primary = models.primary
    return EngineView(
        phase=health.phase, ready=health.ready, paused=paused,
        not_ready_message=health.not_ready_message(), primary=models.settings.model,
        models={name: model_figures(name, runtime, models, now)
                for name, runtime in runtimes.items()},
        loading=loading,
        counts={name: ModelCounts(e.loads, e.load_seconds, dict(e.unloads),
                                  dict(e.requests), dict(e.sizes))
                for name, e in dict(models.outcomes).items()},
        queue=queue_figures(batcher), memory=memory,
        warmup_duration_s=None if primary is None else primary.warmup.duration_s)
