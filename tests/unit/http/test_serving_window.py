"""The serving window of the live samples (``app.http.stats``) on a fake clock: images per
second, median and 95th percentile of the answer times, refusals by reason, per model
and in total; old seconds leave it, and its names are bounded."""

from __future__ import annotations

import statistics

from app.http.stats import (
    DEFAULT,
    MAX_MODELS,
    RATE_S,
    WINDOW_S,
    RequestStats,
    ServingWindow,
    image_model,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scope(path: str, query: bytes = b"") -> dict[str, object]:
    return {"type": "http", "path": path, "query_string": query, "headers": []}


def test_rates_and_percentiles_per_model_and_in_total() -> None:
    clock = Clock()
    window = ServingWindow(clock)
    clock.now += 30  # long after the start: rates are over RATE_S seconds
    times = [0.010 + 0.001 * i for i in range(100)]  # 10 ms .. 109 ms
    for seconds in times:
        window.answered("efficientnet_lite0", seconds)
    for _ in range(20):
        window.answered("efficientnet_lite1", 0.5)
    window.refused("efficientnet_lite0", "rate_limited")
    window.refused("efficientnet_lite1", "insufficient_memory")
    window.refused("efficientnet_lite0", "bad_image")
    window.refused("efficientnet_lite0", "paused")
    report = window.report("efficientnet_lite0")
    lite0 = report.models["efficientnet_lite0"]
    assert lite0.answers == 100 and lite0.images_per_s == 100 / RATE_S
    assert lite0.p50_ms is not None and lite0.p95_ms is not None
    true_median = statistics.median(times) * 1000
    true_p95 = sorted(times)[94] * 1000
    assert abs(lite0.p50_ms - true_median) / true_median < 0.05, lite0
    assert abs(lite0.p95_ms - true_p95) / true_p95 < 0.05, lite0
    assert lite0.refused == {"rate_limited": 1, "overloaded": 0, "bad_input": 1,
                             "insufficient_memory": 0, "other": 1}
    lite1 = report.models["efficientnet_lite1"]
    assert lite1.answers == 20 and abs(lite1.p50_ms - 500) < 25  # type: ignore[operator]
    assert lite1.refused["insufficient_memory"] == 1
    total = report.total
    assert total.answers == 120 and total.images_per_s == 12.0
    assert total.p95_ms is not None and abs(total.p95_ms - 500) < 25  # the slow model's
    assert total.refused["rate_limited"] == 1 and total.refused["insufficient_memory"] == 1
    assert total.refused_per_s["bad_input"] == 1 / RATE_S


def test_old_seconds_leave_the_window() -> None:
    clock = Clock()
    window = ServingWindow(clock)
    window.answered("a", 0.02)
    clock.now += RATE_S + 1  # out of the rate, still in the minute
    report = window.report("a")
    assert report.total.images_per_s == 0 and report.total.answers == 1
    clock.now += WINDOW_S
    report = window.report("a")
    assert report.total.answers == 0 and report.total.p50_ms is None
    assert report.models == {}


def test_the_default_model_is_named_and_early_rates_use_the_time_elapsed() -> None:
    clock = Clock()
    window = ServingWindow(clock)
    clock.now += 2
    for _ in range(4):
        window.answered(DEFAULT, 0.01)
    report = window.report("efficientnet_lite0")
    assert list(report.models) == ["efficientnet_lite0"]
    assert report.total.images_per_s == 2.0  # 4 images in the 2 s since the start


def test_names_are_bounded_and_the_rest_counts_in_the_total() -> None:
    clock = Clock()
    window = ServingWindow(clock)
    for i in range(MAX_MODELS + 10):
        window.refused(f"no-such-model-{i}", "not_found")
    report = window.report("efficientnet_lite0")
    assert len(report.models) == MAX_MODELS
    assert report.total.refused["bad_input"] == MAX_MODELS + 10


def test_request_stats_route_image_requests_to_the_window() -> None:
    clock = Clock()
    stats = RequestStats(clock)
    stats.failed("rate_limited", scope("/v1/classify", b"model=efficientnet_lite1&top_k=3"))
    stats.failed("forbidden", scope("/v1/memory"))  # not an image request
    stats.failed("overloaded", scope("/v2/models/efficientnet_lite2/infer"))
    stats.answered("efficientnet_lite0", "cached", 0.003)
    assert stats.snapshot() == {"rate_limited": 1, "forbidden": 1, "overloaded": 1,
                                "cached": 1}
    report = stats.serving.report("efficientnet_lite0")
    assert set(report.models) == {"efficientnet_lite0", "efficientnet_lite1",
                                  "efficientnet_lite2"}
    assert report.total.refused["other"] == 0 and report.total.answers == 1
    assert image_model(scope("/v1/classify/stream")) == DEFAULT
    assert image_model(scope("/v1/events")) is None
