"""/metrics after real traffic, and the shipped monitoring config against it."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from images import photo
from prometheus_client.parser import text_string_to_metric_families

from app.observe.metrics import GPU_ONLY_SERIES

pytestmark = pytest.mark.slow
MONITORING = Path(__file__).resolve().parents[2] / "assets" / "monitoring"
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


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    return loaded


def panels(within: dict[str, Any]) -> list[dict[str, Any]]:
    """Every graph panel, those inside rows (a collapsed row holds its own) included."""
    found = []
    for panel in within["panels"]:
        found += panels(panel) if panel["type"] == "row" else [panel]
    return found


def exprs() -> list[str]:
    """Every query in the alert rules and the dashboard, its variables' included."""
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    found = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    found += [target["expr"] for panel in panels(dashboard()) for target in panel["targets"]]
    found += [variable["query"] for variable in dashboard()["templating"]["list"]
              if variable["type"] == "query"]
    return found


def test_alert_rules_are_well_formed():
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    names = [rule["alert"] for group in rules["groups"] for rule in group["rules"]]
    assert len(names) == len(set(names)) >= 5
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert rule["expr"] and rule["annotations"]["summary"]
            assert rule["labels"]["severity"] in {"info", "warning", "critical"}


def test_the_replica_row_shows_each_replica_and_leaves_the_appliance_panels_alone():
    """Cluster replicas label their series ``replica``; the appliance's have no such
    label, so only the collapsed Replicas row may filter or group by it."""
    variable = next(v for v in dashboard()["templating"]["list"] if v["name"] == "replica")
    assert variable["multi"] and variable["includeAll"] and variable["allValue"] == ".*"
    assert re.fullmatch(r"label_values\(vramguard_[a-z_]+, replica\)", variable["query"])
    rows = [p for p in dashboard()["panels"] if p["type"] == "row"]
    assert [(r["title"], r["collapsed"]) for r in rows] == [("Replicas", True)]
    queries = [t["expr"] for p in rows[0]["panels"] for t in p["targets"]]
    assert all("by (replica" in q and 'replica=~"$replica"' in q for q in queries)
    used = {name for q in queries for name in re.findall(r"vramguard_[a-z_]+", q)}
    assert used >= {"vramguard_requests_total", "vramguard_request_duration_seconds_bucket",
                    "vramguard_memory_usage_bytes", "vramguard_memory_budget_bytes",
                    "vramguard_queue_depth", "vramguard_rate_limit_fallback"}
    appliance = [t["expr"] for p in dashboard()["panels"] if p["type"] != "row"
                 for t in p["targets"]]
    assert not [q for q in appliance if "replica" in q]


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
