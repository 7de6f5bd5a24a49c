"""A tray controller that counts its polls, and its update loop run by hand: for the tests
of the tray following the server's event stream (a stand-in peer or a real server)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from app.schemas import LiveSample
from tray.client import ApiClient
from tray.controller import TrayController

__all__ = ["CountingClient", "assert_no_stream_left", "follow_until", "polls",
           "stream_threads", "tray_for"]


class CountingClient(ApiClient):
    """The real client, counting its polls."""

    polls = 0

    def sample(self) -> LiveSample:
        self.polls += 1
        return super().sample()


def tray_for(url: str, tmp_path: Path) -> tuple[TrayController, list[str]]:
    messages: list[str] = []
    return TrayController(CountingClient(url, tmp_path / "token"), messages.append), messages


def polls(tray: TrayController) -> int:
    assert isinstance(tray.client, CountingClient)
    return tray.client.polls


def follow_until(tray: TrayController, done: Callable[[int], bool], timeout_s: float) -> int:
    """Run the tray's update loop (refresh, then sleep until news or a second) until
    ``done(times the stream's news woke it)``; that number."""
    woken = 0
    deadline = time.monotonic() + timeout_s
    while not done(woken):
        assert time.monotonic() < deadline, "timed out"
        tray.refresh()
        woken += tray.wait_for_news(1.0)
    return woken


def stream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "vramguard-events"]


def assert_no_stream_left(within_s: float = 5) -> None:
    """Every event-stream thread ends within ``within_s`` (after a test's tray stopped)."""
    deadline = time.monotonic() + within_s
    while stream_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not stream_threads()
