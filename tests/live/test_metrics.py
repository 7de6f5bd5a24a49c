"""/metrics after real traffic, and the shipped monitoring config against it."""

from __future__ import annotations

import re
import time

import pytest
from images import photo
from monitoring_config import exprs
from prometheus_client.parser import text_string_to_metric_families

from app.observe.registry import GPU_ONLY_SERIES

EXPECTED = {
    "vramguard_device_memory_total_bytes", "vramguard_device_memory_used_bytes",
    "vramguard_device_memory_free_bytes", "vramguard_torch_allocated_bytes",
    "vramguard_torch_reserved_bytes", "vramguard_torch_peak_allocated_bytes",
    "vramguard_torch_peak_reserved_bytes", "vramguard_memory_budget_bytes",
    "vramguard_memory_low_watermark_bytes", "vramguard_memory_high_watermark_bytes",
    "vramguard_memory_state", "vramguard_bytes_per_sample", "vramguard_queue_depth",
    "vramguard_in_flight", "vramguard_batch_size", "vramguard_request_duration_seconds",
    "vramguard_requests", "vramguard_rate_limited", "vramguard_oom_events",
    "vramguard_oom_recoveries", "vramguard_oom_failures", "vramguard_cache_hits",
    "vramguard_cache_misses", "vramguard_warmup_duration_seconds",
    "vramguard_leak_suspected", "vramguard_leak_growth_bytes",
    "vramguard_fragmentation_releases", "vramguard_large_allocations",
}


@pytest.fixture(scope="module")
def scraped(server) -> dict:
    """Metric families by name, and every sample name, after some traffic."""
    with server.client() as client:
        for _ in range(3):
            assert client.post("/v1/classify", content=photo(),
                               headers={"Content-Type": "image/jpeg"}).status_code == 200
        client.post("/v1/classify", content=b"junk", headers={"Content-Type": "image/jpeg"})
        time.sleep(1.5)  # one memory-monitor tick
        response = client.get("/metrics")
        device = client.get("/v1/memory").json()["device"]
    assert response.status_code == 200 and response.headers["content-type"].startswith(
        "text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    samples = {s.name for f in families.values() for s in f.samples}
    return {"families": families, "samples": samples, "device": device}


def value(scraped: dict, name: str, **labels: str) -> float:
    for sample in scraped["families"][name].samples:
        if sample.name in (name, f"{name}_total") and all(
                sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    raise KeyError(name)


def test_every_metric_is_exported(scraped):
    missing = EXPECTED - set(scraped["families"])
    assert not missing


def test_values_are_sane_after_traffic(scraped):
    assert value(scraped, "vramguard_requests", route="classify", status="200") >= 3
    assert value(scraped, "vramguard_requests", route="classify", status="400") >= 1
    assert value(scraped, "vramguard_device_memory_total_bytes") > 1e9
    assert 0 < value(scraped, "vramguard_memory_low_watermark_bytes") < value(
        scraped, "vramguard_memory_high_watermark_bytes") <= value(
        scraped, "vramguard_memory_budget_bytes")
    assert value(scraped, "vramguard_memory_state", state="ok") + value(
        scraped, "vramguard_memory_state", state="high") + value(
        scraped, "vramguard_memory_state", state="shedding") == 1
    assert value(scraped, "vramguard_bytes_per_sample") > 1e6
    batch = scraped["families"]["vramguard_batch_size"]
    count = next(s.value for s in batch.samples if s.name == "vramguard_batch_size_count")
    assert count >= 3
    assert value(scraped, "vramguard_warmup_duration_seconds") > 0
    assert value(scraped, "vramguard_oom_events") >= 0


def test_monitoring_config_names_only_exported_metrics(scraped):
    used = {name for expr in exprs() for name in re.findall(r"vramguard_[a-z_]+", expr)}
    assert used
    gpu_only: frozenset[str] = frozenset()
    if scraped["device"] == "cpu":
        # Absent on a CPU, not zero, so that no rule on them fires there; the config may
        # still name them (a GPU's scrape has them).
        assert not GPU_ONLY_SERIES & set(scraped["families"])
        gpu_only = GPU_ONLY_SERIES
    assert used >= GPU_ONLY_SERIES  # the shipped rules and dashboard do use them
    unknown = used - scraped["samples"] - set(scraped["families"]) - gpu_only
    assert not unknown, f"alert or dashboard expressions name unknown metrics: {unknown}"
