"""The tray follows a real server's event stream: samples without polling, polling while
the stream is refused, a server that starts later and goes (the parser, the back-off and
stand-in peers: unit/tray/test_tray_events.py)."""

from __future__ import annotations

from collections.abc import Iterator

import live_server as live_server_module
import pytest
from live_server import free_port, live_server
from live_views import open_slots_taken
from tray_follow import assert_no_stream_left, follow_until, polls, tray_for


@pytest.fixture
def no_stream_left() -> Iterator[None]:
    yield
    assert_no_stream_left()


def test_follows_the_stream_without_polling(server, tmp_path, no_stream_left):
    tray, _ = tray_for(server.url, tmp_path)
    tray.follow()
    try:
        times: list[float] = []

        def two_samples() -> bool:
            if tray.sample is not None and tray.sample.t not in times:
                times.append(tray.sample.t)
            return len(times) >= 2

        woken = follow_until(tray, lambda news: two_samples(), 15)
        assert woken >= 1 and polls(tray) == 0
        assert tray.status == "running" and tray.tooltip().startswith("vramguard: healthy, ")
        assert tray.lines()[3] == "State: healthy"
    finally:
        tray.stop_following()


def test_a_refused_stream_falls_back_to_polling_then_follows_again(server, tmp_path,
                                                                   no_stream_left):
    tray, _ = tray_for(server.url, tmp_path)
    try:
        with open_slots_taken(server.url):
            tray.follow()
            woken = follow_until(tray, lambda news: polls(tray) >= 3, 15)
            assert woken == 0  # nothing came over the stream
            assert tray.status == "running" and tray.lines()[3] == "State: healthy"
        # room again: the stream is tried again (after Retry-After), and polling stops
        follow_until(tray, lambda news: news >= 1, 20)
        before = polls(tray)
        follow_until(tray, lambda news: news >= 2, 15)
        assert polls(tray) == before and tray.status == "running"
    finally:
        tray.stop_following()


def test_follows_a_server_that_starts_later_and_sees_it_go(tmp_path, monkeypatch,
                                                          no_stream_left):
    port = free_port()
    monkeypatch.setattr(live_server_module, "free_port", lambda: port)
    tray, _ = tray_for(f"http://127.0.0.1:{port}", tmp_path)
    tray.follow()
    try:
        follow_until(tray, lambda news: news >= 1, 10)  # no server: that is news too
        assert tray.down and tray.status == "starting"
        with live_server(tmp_path):
            follow_until(tray, lambda news: tray.sample is not None, 30)
            assert tray.status == "running"
        follow_until(tray, lambda news: tray.down, 15)  # the stream ended with the server
        assert tray.status.startswith("not answering: ")
        assert polls(tray) == 0
    finally:
        tray.stop_following()
