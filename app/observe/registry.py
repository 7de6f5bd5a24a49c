"""The metrics registry (``GET /metrics``), one per app: the request instruments, and
the tables of memory series the collector reads from each ``MemoryReport``.

It imports nothing of the app but the schemas its tables read, so the app's state can hold
it and the collector (``app.observe.collector``) can read that state, one way. A new memory
figure starts as a ``MemoryReport`` field and a row here; a figure only a GPU has goes in
``GPU_GAUGES``, whose series is absent, not 0, where the field is None (the CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from app.schemas import MemoryReport

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

    def register(self, collector: Collector) -> None:
        """Read ``collector``'s figures at every scrape too (the server's, over its state)."""
        self.registry.register(collector)

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
