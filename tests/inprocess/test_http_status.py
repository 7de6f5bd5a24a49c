"""/v1/stats and /metrics rendered by the real app in process: shapes, request counters by
outcome, route family and status, and every memory series from a known MemoryReport."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from asgi import (
    WARMUP_S,
    Series,
    built_app,
    client,
    parse,
    png,
    state_of,
    value,
)
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from app.memory.guard import GuardState
from app.schemas import MemoryReport, ProfilePoint, StatsResponse

pytestmark = pytest.mark.anyio
MEMORY_SERIES = {  # every memory gauge and counter, by hand (not from app.observe.registry)
    "vramguard_device_memory_total_bytes", "vramguard_device_memory_used_bytes",
    "vramguard_device_memory_free_bytes", "vramguard_torch_allocated_bytes",
    "vramguard_torch_reserved_bytes", "vramguard_torch_peak_allocated_bytes",
    "vramguard_torch_peak_reserved_bytes", "vramguard_memory_budget_bytes",
    "vramguard_memory_low_watermark_bytes", "vramguard_memory_high_watermark_bytes",
    "vramguard_memory_usage_bytes", "vramguard_bytes_per_sample", "vramguard_max_batch_now",
    "vramguard_memory_state", "vramguard_oom_events", "vramguard_oom_recoveries",
    "vramguard_oom_failures", "vramguard_memory_state_changes", "vramguard_idle_releases",
    "vramguard_cache_empties",
}


@pytest.fixture
def app(tmp_path: Path) -> Iterator[FastAPI]:
    with built_app(tmp_path) as app:
        yield app


def families(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


def requests_counted(series: Series) -> dict[tuple[str, str], float]:
    """The request counter as {(route family, status): count}."""
    return {(dict(labels)["route"], dict(labels)["status"]): count
            for (name, labels), count in series.items() if name == "vramguard_requests_total"}


def report() -> MemoryReport:
    """A memory report in which every figure is different, so a swapped one shows."""
    return MemoryReport(
        device="cuda:0", source="nvml", nvml=True, total_bytes=24_000_000_000,
        used_bytes=9_000_000_000, free_bytes=15_000_000_000, allocated_bytes=1_100_000_000,
        reserved_bytes=1_300_000_000, peak_allocated_bytes=2_200_000_000,
        peak_reserved_bytes=2_400_000_000, others_bytes=6_000_000_000,
        weights_bytes=20_000_000, overhead_bytes=500_000_000,
        configured_budget_bytes=8_000_000_000, budget_bytes=7_000_000_000,
        low_watermark_bytes=5_250_000_000, high_watermark_bytes=6_300_000_000,
        usage_bytes=6_500_000_000, state=GuardState.HIGH, fixed_bytes=90_000_000,
        bytes_per_sample=45_000_000, profiled_bytes_per_sample=40_000_000,
        profile_points=[ProfilePoint(batch_size=1, peak_bytes=130_000_000)],
        max_batch_now=17, cpu_memory_cap_bytes=None, process_used_bytes=3_000_000_000,
        oom_events=3, oom_recoveries=2, oom_failures=1, state_changes=5, idle_releases=4,
        cache_empties=6)


# --- /v1/stats -------------------------------------------------------------------------------


async def test_stats_before_warmup(app: FastAPI) -> None:
    async with client(app) as http:
        response = await http.get("/v1/stats")
    assert response.status_code == 200
    body = response.json()
    assert set(body) == set(StatsResponse.model_fields)
    assert body["uptime_s"] >= 0 and body["phase"] == "starting" and body["paused"] is False
    for name in ("queue_depth", "in_flight", "batches", "batched_images", "largest_batch",
                 "expired_in_queue", "withdrawn_in_queue", "rate_limited"):
        assert body[name] == 0, name
    assert body["mean_batch_size"] == 0.0
    assert body["requests"] == {} and body["cache_entries"] is None  # the cache is off


async def test_stats_count_answers_by_outcome(tmp_path: Path) -> None:
    with built_app(tmp_path, read_burst=8) as app:
        async with client(app) as http:
            for path in ("/a", "/b", "/c"):
                assert (await http.get(path)).status_code == 404
            assert (await http.post("/v1/classify?top_k=0")).status_code == 400
            assert (await http.post("/v1/classify")).status_code == 503
            while (await http.get("/healthz")).status_code != 429:
                pass
            state_of(app).engine.paused = True
            body = (await http.get("/v1/stats", headers={"X-Client-Id": "monitor"})).json()
    assert body["requests"] == {"not_found": 3, "bad_request": 1, "not_ready": 1,
                                "rate_limited": 1}
    assert body["rate_limited"] == 1 and body["paused"] is True


async def test_stats_and_metrics_follow_the_result_cache(tmp_path: Path) -> None:
    """With the cache on, one image classified twice: computed once, then a cache hit."""
    with built_app(tmp_path, ready=True, cache=True) as app:
        async with client(app) as http:
            assert (await http.get("/v1/stats")).json()["cache_entries"] == 0
            for _ in range(2):
                answer = await http.post("/v1/classify", files={"file": ("a.png", png())})
                assert answer.status_code == 200, answer.text
            body = (await http.get("/v1/stats")).json()
            series = parse((await http.get("/metrics")).text)
    assert answer.json()["cached"] is True
    assert body["cache_entries"] == 1 and body["requests"] == {"ok": 1, "cached": 1}
    assert value(series, "vramguard_cache_hits_total") == 1
    assert value(series, "vramguard_cache_misses_total") == 1


# --- /metrics --------------------------------------------------------------------------------


async def test_metrics_before_warmup(app: FastAPI) -> None:
    async with client(app) as http:
        first = await http.get("/metrics")
        second = await http.get("/metrics")
    assert first.status_code == 200
    assert first.headers["content-type"].startswith("text/plain; version=")
    series = parse(second.text)
    assert requests_counted(series) == {}  # scrapes do not count themselves
    assert value(series, "vramguard_ready") == 0
    assert value(series, "vramguard_queue_depth") == 0
    assert value(series, "vramguard_in_flight") == 0
    assert value(series, "vramguard_batch_size_count") == 0
    assert value(series, "vramguard_batch_size_bucket", le="+Inf") == 0
    assert value(series, "vramguard_rate_limited_total") == 0
    assert value(series, "vramguard_cache_hits_total") == 0
    assert not MEMORY_SERIES & families(second.text)  # no figures before warmup measured them
    assert "vramguard_warmup_duration_seconds" not in families(second.text)


async def test_requests_are_counted_by_route_family_and_status(tmp_path: Path) -> None:
    with built_app(tmp_path, read_burst=4, read_per_s=0.001) as app:
        async with client(app) as http:
            for _ in range(2):
                await http.get("/healthz")
            await http.get("/nowhere")  # a 404 costs no token
            await http.post("/v1/classify")  # 503: not ready
            await http.post("/v1/classify?top_k=0")
            await http.post("/v1/memory/empty-cache")  # 401: no token
            await http.get("/healthz", headers={"Host": "evil.example"})  # refused by a gate
            await http.get("/healthz")
            await http.get("/healthz")  # the 4th read in the burst
            await http.get("/healthz")  # 429
            scrape = await http.get("/metrics", headers={"X-Client-Id": "prometheus"})
            series = parse(scrape.text)
    assert requests_counted(series) == {
        ("read", "200"): 4, ("read", "404"): 1, ("read", "403"): 1, ("read", "429"): 1,
        ("classify", "503"): 1, ("classify", "400"): 1, ("admin", "401"): 1,
    }
    assert value(series, "vramguard_request_duration_seconds_count",
                 route="read", status="200") == 4
    assert value(series, "vramguard_rate_limited_total") == 1


async def test_every_memory_series_renders_from_the_report(tmp_path: Path) -> None:
    with built_app(tmp_path, ready=True) as app:
        state_of(app).engine.last_report = report()
        async with client(app) as http:
            text = (await http.get("/metrics")).text
    assert families(text) >= MEMORY_SERIES
    series = parse(text)
    expected = {
        "vramguard_device_memory_total_bytes": 24_000_000_000,
        "vramguard_device_memory_used_bytes": 9_000_000_000,
        "vramguard_device_memory_free_bytes": 15_000_000_000,
        "vramguard_torch_allocated_bytes": 1_100_000_000,
        "vramguard_torch_reserved_bytes": 1_300_000_000,
        "vramguard_torch_peak_allocated_bytes": 2_200_000_000,
        "vramguard_torch_peak_reserved_bytes": 2_400_000_000,
        "vramguard_memory_budget_bytes": 7_000_000_000,
        "vramguard_memory_low_watermark_bytes": 5_250_000_000,
        "vramguard_memory_high_watermark_bytes": 6_300_000_000,
        "vramguard_memory_usage_bytes": 6_500_000_000,
        "vramguard_bytes_per_sample": 45_000_000,
        "vramguard_max_batch_now": 17,
        "vramguard_oom_events_total": 3,
        "vramguard_oom_recoveries_total": 2,
        "vramguard_oom_failures_total": 1,
        "vramguard_memory_state_changes_total": 5,
        "vramguard_idle_releases_total": 4,
        "vramguard_cache_empties_total": 6,
        "vramguard_ready": 1,
        "vramguard_warmup_duration_seconds": WARMUP_S,
    }
    assert {name: value(series, name) for name in expected} == expected
    states = {labels: v for (name, labels), v in series.items()
              if name == "vramguard_memory_state"}
    assert states == {(("state", "ok"),): 0, (("state", "high"),): 1, (("state", "shedding"),): 0}


@pytest.mark.parametrize("state", list(GuardState))
async def test_exactly_one_memory_state_is_set(tmp_path: Path, state: GuardState) -> None:
    with built_app(tmp_path) as app:
        state_of(app).engine.last_report = report().model_copy(update={"state": state})
        async with client(app) as http:
            series = parse((await http.get("/metrics")).text)
    assert {s: value(series, "vramguard_memory_state", state=s.value) for s in GuardState} == {
        s: (1.0 if s is state else 0.0) for s in GuardState}
