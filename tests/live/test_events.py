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
