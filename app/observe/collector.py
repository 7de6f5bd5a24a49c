"""``AppCollector``: the scrape-time figures of ``/metrics``, read one way from the app's
state: the engine's view (memory from its last report, the queue, each model), the
request counts and the rate limiter's.

Scraping never touches the device: the memory figures are the snapshot the memory monitor
takes every second. The server registers one collector per state (``make_state``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from app.engine.view import EngineView
from app.http.state import AppState
from app.observe.registry import BATCH_BUCKETS, GPU_GAUGES, MEMORY_GAUGES, OOM_COUNTERS
from app.schemas import GuardState, MemoryReport


class AppCollector(Collector):
    """Figures read from the app's state at scrape time."""

    def __init__(self, state: AppState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        view, stats = self.state.engine.view(), self.state.stats
        if view.memory is not None:
            yield from self._memory(view.memory)
        queue = view.queue
        yield GaugeMetricFamily("vramguard_queue_depth", "Images waiting for the model.",
                                value=queue.queue_depth)
        yield GaugeMetricFamily("vramguard_in_flight", "Images in the running batch.",
                                value=queue.in_flight)
        buckets, total = _buckets(queue.batch_sizes)
        yield HistogramMetricFamily("vramguard_batch_size", "Images per batch.",
                                    buckets=buckets, sum_value=total)
        counts = stats.snapshot()
        yield CounterMetricFamily("vramguard_cache_hits", "Answers from the result cache.",
                                  value=counts.get("cached", 0))
        yield CounterMetricFamily("vramguard_cache_misses", "Images the model had to compute.",
                                  value=counts.get("ok", 0) if self.state.cache else 0)
        yield CounterMetricFamily("vramguard_rate_limited", "Requests refused with 429.",
                                  value=self.state.limiter.rejected)
        yield GaugeMetricFamily("vramguard_rate_limit_fallback", "1 while the limits shared "
                                "through Redis cannot be reached and this process applies "
                                "its own share of them.",
                                value=1.0 if self.state.limiter.fallback else 0.0)
        if view.warmup_duration_s is not None:
            yield GaugeMetricFamily("vramguard_warmup_duration_seconds", "How long warmup took.",
                                    value=view.warmup_duration_s)
        yield GaugeMetricFamily("vramguard_ready", "1 once the model is warmed up.",
                                value=1.0 if view.ready else 0.0)
        yield from _models(view)

    @staticmethod
    def _memory(report: MemoryReport) -> Iterator[Metric]:
        for name, (read, doc) in MEMORY_GAUGES.items():
            yield GaugeMetricFamily(f"vramguard_{name}", doc, value=read(report))
        for name, (read_gpu, doc) in GPU_GAUGES.items():
            if (figure := read_gpu(report)) is not None:
                yield GaugeMetricFamily(f"vramguard_{name}", doc, value=figure)
        family = GaugeMetricFamily("vramguard_memory_state", "1 for the current memory "
                                   "state (ok, high, shedding).", labels=["state"])
        for state in GuardState:
            family.add_metric([state.value], 1.0 if report.state is state else 0.0)
        yield family
        for name, (read, doc) in OOM_COUNTERS.items():
            yield CounterMetricFamily(f"vramguard_{name}", doc, value=read(report))


def _models(view: EngineView) -> Iterator[Metric]:
    """Per model (label ``model``): what is loaded, loads, unloads by reason, load time,
    requests by outcome and its batch sizes; counts survive the model's unloading."""
    loaded = GaugeMetricFamily("vramguard_model_loaded", "1 for each loaded model.",
                               labels=["model"])
    weights = GaugeMetricFamily("vramguard_model_weights_bytes", "Weights of each "
                                "loaded model on the device.", labels=["model"])
    size = GaugeMetricFamily("vramguard_model_batch_size", "Batch size in force for "
                             "each loaded model.", labels=["model"])
    for name, model in view.models.items():
        loaded.add_metric([name], 1.0)
        weights.add_metric([name], model.weights_bytes)
        size.add_metric([name], model.max_batch)
    loads = CounterMetricFamily("vramguard_model_loads", "Model loads.", labels=["model"])
    seconds = CounterMetricFamily("vramguard_model_load_seconds", "Time spent loading "
                                  "and warming up models.", labels=["model"])
    unloads = CounterMetricFamily("vramguard_model_unloads", "Model unloads by reason: "
                                  "evicted (to make room), expired (keep-alive), admin, "
                                  "did_not_fit, removed (its folder was removed or "
                                  "replaced).", labels=["model", "reason"])
    requests = CounterMetricFamily("vramguard_model_requests", "Images answered per "
                                   "model: ok (computed) or cached.",
                                   labels=["model", "outcome"])
    batches = HistogramMetricFamily("vramguard_model_batch_size_images", "Images per "
                                    "batch, per model.", labels=["model"])
    for name, counted in view.counts.items():
        loads.add_metric([name], counted.loads)
        seconds.add_metric([name], counted.load_seconds)
        for reason, count in counted.unloads.items():
            unloads.add_metric([name, reason], count)
        for outcome, count in counted.requests.items():
            requests.add_metric([name, outcome], count)
        buckets, total = _buckets(counted.batch_sizes)
        batches.add_metric([name], buckets, sum_value=total)
    yield from (loaded, weights, size, loads, seconds, unloads, requests, batches)


def _buckets(sizes: Mapping[int, int]) -> tuple[list[tuple[str, float]], float]:
    """A histogram's cumulative buckets and sum from counts of batches by size."""
    buckets: list[tuple[str, float]] = [
        (str(bound), sum(n for size, n in sizes.items() if size <= bound))
        for bound in BATCH_BUCKETS]
    buckets.append(("+Inf", sum(sizes.values())))
    return buckets, sum(size * n for size, n in sizes.items())
