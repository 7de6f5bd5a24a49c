"""Prometheus metrics (`GET /metrics`), each app with its own registry.

Request counts and latencies are recorded by a small ASGI middleware, so
refusals made before any route runs (403, 429, 413, 503 for uploads) are
counted too. Memory, queue and guard figures are read at scrape time from the
snapshot the memory monitor takes every second: scraping never touches the
device.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.gates.rate_limit import route_family
from app.memory.guard import GuardState
from app.schemas import MemoryReport

if TYPE_CHECKING:
    from app.http.state import AppState

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 30)
MEMORY_GAUGES: dict[str, tuple[Callable[[MemoryReport], int], str]] = {
    "device_memory_total_bytes": (lambda r: r.total_bytes, "Memory of the whole device."),
    "device_memory_used_bytes": (lambda r: r.used_bytes,
                                 "Memory in use on the device, all programs."),
    "device_memory_free_bytes": (lambda r: r.free_bytes, "Free memory on the device."),
    "torch_allocated_bytes": (lambda r: r.allocated_bytes, "Bytes held by live tensors."),
    "torch_reserved_bytes": (lambda r: r.reserved_bytes, "Bytes held by PyTorch's allocator."),
    "torch_peak_allocated_bytes": (lambda r: r.peak_allocated_bytes,
                                   "Peak of allocated since reset."),
    "torch_peak_reserved_bytes": (lambda r: r.peak_reserved_bytes,
                                  "Peak of reserved since reset."),
    "memory_budget_bytes": (lambda r: r.budget_bytes,
                            "Current memory budget for images in flight."),
    "memory_low_watermark_bytes": (lambda r: r.low_watermark_bytes,
                                   "Below this, shedding ends."),
    "memory_high_watermark_bytes": (lambda r: r.high_watermark_bytes,
                                    "Above this, load is shed."),
    "memory_usage_bytes": (lambda r: r.usage_bytes,
                           "Memory use the watermarks are compared with."),
    "bytes_per_sample": (lambda r: r.bytes_per_sample, "Measured memory per image (k)."),
    "max_batch_now": (lambda r: r.max_batch_now, "Images that fit in a batch now."),
    "leak_suspected": (lambda r: int(r.leak_suspected),
                       "1 while memory left in use keeps rising over idle periods."),
    "leak_growth_bytes": (lambda r: r.leak_growth_bytes,
                          "Memory held at the last idle period beyond the warm level."),
}
# Series that only a GPU with NVML gives: absent from a CPU's /metrics, not zero, so that
# a rule on them cannot fire (or be satisfied) on a machine that has no such figure.
GPU_GAUGES: dict[str, tuple[Callable[[MemoryReport], float | None], str]] = {
    "gpu_utilization_ratio": (lambda r: r.gpu_utilization_ratio,
                              "Share of time the GPU ran work, any program's (NVML)."),
}
GPU_ONLY_SERIES = frozenset(f"vramguard_{name}" for name in GPU_GAUGES)
OOM_COUNTERS: dict[str, tuple[Callable[[MemoryReport], int], str]] = {
    "oom_events": (lambda r: r.oom_events, "Out-of-memory errors in a forward pass."),
    "oom_recoveries": (lambda r: r.oom_recoveries,
                       "Batches answered in full after an out-of-memory."),
    "oom_failures": (lambda r: r.oom_failures,
                     "Images refused because they did not fit alone."),
    "memory_state_changes": (lambda r: r.state_changes, "Changes of the memory state."),
    "idle_releases": (lambda r: r.idle_releases,
                      "Times cached memory was given back while idle."),
    "cache_empties": (lambda r: r.cache_empties, "Empty-cache requests (tray, dashboard, API)."),
    "fragmentation_releases": (lambda r: r.fragmentation_releases,
                               "Idle releases of a cache holding 5 times what was in use."),
    "large_allocations": (lambda r: r.large_allocations,
                          "Places logged for an allocation beyond a batch's measured need."),
}


class AppCollector(Collector):
    """Figures read from the app's state at scrape time."""

    def __init__(self, state: AppState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        engine, stats = self.state.engine, self.state.stats
        report = engine.last_report
        if report is not None:
            yield from self._memory(report)
        batcher = engine.batcher
        yield GaugeMetricFamily("vramguard_queue_depth", "Images waiting for the model.",
                                value=batcher.queue_depth)
        yield GaugeMetricFamily("vramguard_in_flight", "Images in the running batch.",
                                value=batcher.in_flight)
        yield self._batch_sizes()
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
        if engine.runtime is not None:
            yield GaugeMetricFamily("vramguard_warmup_duration_seconds", "How long warmup took.",
                                    value=engine.runtime.warmup.duration_s)
        yield GaugeMetricFamily("vramguard_ready", "1 once the model is warmed up.",
                                value=1.0 if engine.ready else 0.0)
        yield from self._models()

    def _models(self) -> Iterator[Metric]:
        """Per model (label ``model``): what is loaded, loads, unloads by reason, load time,
        requests by outcome and its batch sizes; counts survive the model's unloading."""
        engine = self.state.engine
        runtimes = dict(engine.runtimes)
        events = dict(engine.events)
        loaded = GaugeMetricFamily("vramguard_model_loaded", "1 for each loaded model.",
                                   labels=["model"])
        weights = GaugeMetricFamily("vramguard_model_weights_bytes", "Weights of each "
                                    "loaded model on the device.", labels=["model"])
        size = GaugeMetricFamily("vramguard_model_batch_size", "Batch size in force for "
                                 "each loaded model.", labels=["model"])
        for name, runtime in runtimes.items():
            loaded.add_metric([name], 1.0)
            weights.add_metric([name], runtime.memory.weights_bytes)
            size.add_metric([name], runtime.guard.max_batch)
        loads = CounterMetricFamily("vramguard_model_loads", "Model loads.", labels=["model"])
        seconds = CounterMetricFamily("vramguard_model_load_seconds", "Time spent loading "
                                      "and warming up models.", labels=["model"])
        unloads = CounterMetricFamily("vramguard_model_unloads", "Model unloads by reason: "
                                      "evicted (to make room), expired (keep-alive), admin, "
                                      "did_not_fit.", labels=["model", "reason"])
        requests = CounterMetricFamily("vramguard_model_requests", "Images answered per "
                                       "model: ok (computed) or cached.",
                                       labels=["model", "outcome"])
        batches = HistogramMetricFamily("vramguard_model_batch_size_images", "Images per "
                                        "batch, per model.", labels=["model"])
        for name, counted in events.items():
            loads.add_metric([name], counted.loads)
            seconds.add_metric([name], counted.load_seconds)
            for reason, count in counted.unloads.items():
                unloads.add_metric([name, reason], count)
            for outcome, count in counted.requests.items():
                requests.add_metric([name, outcome], count)
            buckets, total = _buckets(dict(counted.sizes))
            batches.add_metric([name], buckets, sum_value=total)
        yield from (loaded, weights, size, loads, seconds, unloads, requests, batches)

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

    def _batch_sizes(self) -> Metric:
        buckets, total = _buckets(dict(self.state.engine.batcher.stats.sizes))
        return HistogramMetricFamily("vramguard_batch_size", "Images per batch.",
                                     buckets=buckets, sum_value=total)


def _buckets(sizes: dict[int, int]) -> tuple[list[tuple[str, float]], float]:
    """A histogram's cumulative buckets and sum from counts of batches by size."""
    buckets: list[tuple[str, float]] = [
        (str(bound), sum(n for size, n in sizes.items() if size <= bound))
        for bound in BATCH_BUCKETS]
    buckets.append(("+Inf", sum(sizes.values())))
    return buckets, sum(size * n for size, n in sizes.items())


class Metrics:
    """The registry and the request instruments of one app. ``replica``: a cluster
    replica's name, added as a ``replica`` label to every series it renders (each replica
    is scraped on its own port, app/cluster/replica.py); None for the appliance."""

    def __init__(self, replica: str | None = None) -> None:
        self.replica = replica
        self.registry = CollectorRegistry()
        self.requests = Counter("vramguard_requests", "HTTP requests answered.",
                                ["route", "status"], registry=self.registry)
        self.latency = Histogram("vramguard_request_duration_seconds", "Time to answer.",
                                 ["route", "status"], buckets=LATENCY_BUCKETS,
                                 registry=self.registry)

    def collect_from(self, state: AppState) -> None:
        """Read the app's figures at every scrape (once its state exists)."""
        self.registry.register(AppCollector(state))

    def render(self) -> bytes:
        if self.replica is None:
            return generate_latest(self.registry)
        return generate_latest(_Labelled(self.registry, "replica", self.replica))


class _Labelled(Collector):
    """Every series of ``source`` with one more label."""

    def __init__(self, source: Collector, name: str, value: str) -> None:
        self.source = source
        self.name = name
        self.value = value

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [sample._replace(labels={**sample.labels, self.name: self.value})
                                for sample in family.samples]
            yield labelled


class MetricsMiddleware:
    """Outermost ASGI layer: counts and times every HTTP request by route family and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/metrics":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            route = route_family(scope["method"], scope["path"])
            labels = (route, str(status))
            self.metrics.requests.labels(*labels).inc()
            self.metrics.latency.labels(*labels).observe(time.perf_counter() - started)
