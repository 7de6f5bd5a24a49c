"""Live events from a real server: the SSE stream's samples, and a shutdown an open stream
does not hold up (the hub itself: unit/http/test_live_feed.py)."""

from __future__ import annotations

import json

import httpx


def test_server_streams_samples_every_second(server):
    events: list[tuple[str, dict]] = []
    with httpx.stream("GET", f"{server.url}/v1/events", timeout=10) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: ") and kind:
                events.append((kind, json.loads(line[6:])))
                if len([e for e in events if e[0] == "sample"]) == 2:
                    break
    samples = [data for kind, data in events if kind == "sample"]
    assert 0.5 < samples[1]["t"] - samples[0]["t"] < 3
    for key in ("allocated_bytes", "reserved_bytes", "budget_bytes", "high_watermark_bytes",
                "low_watermark_bytes", "state", "queue_depth", "mean_batch_size", "requests"):
        assert key in samples[0]


def test_an_open_event_stream_does_not_hold_up_a_shutdown(tmp_path):
    """Without ending the streams, uvicorn waits its whole graceful timeout (10 s) for
    them: `vramguard stop` and the installer would wait with it."""
    import signal
    import threading

    from live_server import live_server

    with live_server(tmp_path, "--no-cache") as running:
        opened = threading.Event()

        def listen() -> None:
            with httpx.stream("GET", f"{running.url}/v1/events", timeout=30) as response:
                for _line in response.iter_lines():
                    opened.set()

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        assert opened.wait(10)
        running.process.send_signal(signal.SIGTERM)
        assert running.process.wait(6) == 0
        listener.join(5)
        assert not listener.is_alive()


def next_sample(url: str, after: float, timeout: float = 20) -> dict:
    """The first sample of the event stream taken after ``after`` (Unix time)."""
    with httpx.stream("GET", f"{url}/v1/events", timeout=timeout) as response:
        kind = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: ") and kind == "sample":
                sample = json.loads(line[6:])
                if sample["t"] > after:
                    return sample
    raise AssertionError("the stream ended")


def test_samples_carry_the_serving_of_the_last_minute(tmp_path):
    """Answers and refusals of a real server, as the dashboard's serving charts read them:
    the photos answered, their answer times (the server's own, so never more than what
    the client waited), and the refusals by reason."""
    import time

    from images import photo
    from live_server import live_server

    with live_server(tmp_path, "--no-cache", "--models", "efficientnet_lite1",
                     env={"VRAMGUARD_CLASSIFY_BURST": "6",
                          "VRAMGUARD_CLASSIFY_PER_S": "0.05"}) as running, \
            running.client() as http:
        waited = []
        for model in ("efficientnet_lite0", "efficientnet_lite0", "efficientnet_lite1"):
            started = time.perf_counter()
            answer = http.post("/v1/classify", params={"model": model}, content=photo(),
                               headers={"Content-Type": "image/jpeg"})
            waited.append((time.perf_counter() - started) * 1000)
            assert answer.status_code == 200, answer.text
        bad = http.post("/v1/classify", content=b"not a photo",
                        headers={"Content-Type": "image/jpeg"})
        assert bad.status_code == 400
        refused = [http.post("/v1/embed", content=photo(), headers={
            "Content-Type": "image/jpeg", "X-Client-Id": "flood"}).status_code
            for _ in range(8)]
        assert refused.count(429) >= 2
        serving = next_sample(running.url, time.time())["serving"]
    assert serving["window_s"] == 60
    total, models = serving["total"], serving["models"]
    assert total["answers"] == 3 + refused.count(200)
    assert models["efficientnet_lite1"]["answers"] == 1
    assert models["efficientnet_lite0"]["answers"] == 2 + refused.count(200)
    assert total["refused"] == {"rate_limited": refused.count(429), "overloaded": 0,
                                "bad_input": 1, "insufficient_memory": 0, "other": 0}
    assert models["efficientnet_lite0"]["refused"]["bad_input"] == 1
    assert 0 < models["efficientnet_lite1"]["p50_ms"] <= waited[2] * 1.05
    assert total["p50_ms"] <= total["p95_ms"]
