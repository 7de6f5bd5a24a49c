"""What the tray knows and does, independent of any tray library (tested headless).

It follows the server's event stream (polling once a second only while the
server refuses the stream, or before ``follow()``), turns each sample into an
icon, a tooltip and menu lines, raises one notification per memory episode,
runs the menu's actions through the API, and supervises the server process it
started: a server that dies is restarted, and the menu says why it stopped.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from PIL import Image

from app.instance import instance_folder
from app.memory.guard import GuardState
from app.schemas import LiveSample
from app.units import human_bytes
from tray.client import ApiClient, NotVramguard, ServerDown
from tray.dashboard import DashboardOpener
from tray.event_stream import EventStream
from tray.icon import draw_icon
from tray.text import Notifier, gauge_of, menu_lines, tooltip

log = logging.getLogger("vramguard.tray")
RESTART_BACKOFF_S = (1, 2, 5, 10, 30)


class TrayController:
    def __init__(self, client: ApiClient, notify: Callable[[str], None],
                 start_server: Callable[[], subprocess.Popen[bytes]] | None = None) -> None:
        self.client = client
        self.notify = notify
        self.start_server = start_server
        self.sample: LiveSample | None = None
        self.status = "starting"
        self.server: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.last_stop: str | None = None
        self.stopped = False  # the server we started was stopped on purpose: quit the tray
        self._next_start = 0.0
        self._notifier = Notifier()
        self._lock = threading.Lock()  # the stream's thread and the tray's share the reading
        self._news = threading.Event()
        self._stream: EventStream | None = None

    # -- reading -----------------------------------------------------------------------

    def follow(self) -> None:
        """Follow the server's event stream from now on instead of polling it."""
        if self._stream is None:
            self._stream = EventStream(self.client.base_url, self)
            self._stream.start()

    def stop_following(self) -> None:
        """End the stream's thread (the tray is quitting); wakes ``wait_for_news``."""
        if self._stream is not None:
            self._stream.stop()
        self._news.set()

    def refresh(self) -> None:
        """Supervise the server we started, and poll it unless the stream is followed."""
        self._supervise()
        if self._stream is None or self._stream.refused:
            self._poll()

    def wait_for_news(self, timeout_s: float) -> bool:
        """Sleep until the stream brings something to show, or ``timeout_s`` passes."""
        news = self._news.wait(timeout_s)
        self._news.clear()
        return news

    def stream_sample(self, sample: LiveSample) -> None:
        self._show(sample)
        self._news.set()

    def stream_state(self, state: GuardState) -> None:
        """Recolour now; the sample with the figures follows within the second."""
        with self._lock:
            sample = self.sample
        if sample is not None:
            self._show(sample.model_copy(update={"state": state}))
            self._news.set()

    def stream_lost(self, problem: str) -> None:
        self._show(None, problem)
        self._news.set()

    def _poll(self) -> None:
        try:
            sample = self.client.sample()
        except ServerDown as exc:
            self._show(None, str(exc))
        else:
            self._show(sample)

    def _show(self, sample: LiveSample | None, problem: str = "") -> None:
        """Take a reading (None: the server does not answer, keep nothing stale) and
        notify when memory just got tight."""
        with self._lock:
            self.sample = sample
            if sample is not None:
                self.status = "running"
            elif self.status == "running":
                self.status = f"not answering: {problem}"
            message = self._notifier.update(gauge_of(sample).state)
        if message:
            self.notify(message)

    def icon(self, size: int = 64) -> Image.Image:
        return draw_icon(gauge_of(self.sample), size)

    def tooltip(self) -> str:
        return tooltip(self.sample)

    def lines(self) -> list[str]:
        with self._lock:
            sample, status = self.sample, self.status
        lines = menu_lines(sample)
        if sample is None and status not in ("running", "starting"):
            lines.append(f"Why: {status}")
        if self.last_stop:
            lines.append(f"Last stop: {self.last_stop}")
        return lines

    @property
    def down(self) -> bool:
        return self.sample is None

    @property
    def paused(self) -> bool:
        return self.sample is not None and self.sample.paused

    # -- actions (menu items) ------------------------------------------------------------

    def empty_cache(self) -> str:
        result = self._act(self.client.empty_cache)
        if isinstance(result, str):
            return result
        return f"Gave back {human_bytes(result['freed_bytes'])} of GPU memory."

    def reset_peak(self) -> str:
        result = self._act(self.client.reset_peak)
        return result if isinstance(result, str) else "Peak reset."

    def toggle_pause(self) -> str:
        result = self._act(lambda: self.client.set_paused(not self.paused))
        return result if isinstance(result, str) else (
            "Paused." if result["paused"] else "Taking images again.")

    def open_dashboard(self) -> str | None:
        """Open the dashboard, signed in, in the browser; None when it opened, else what
        to tell the person (nothing is opened for a server that fails the challenge)."""
        opener = DashboardOpener(self.client, instance_folder(self.client.token_file))
        try:
            opener.open()
        except (ServerDown, NotVramguard, RuntimeError) as exc:
            return f"Could not open the dashboard: {exc}"
        return None

    def _act(self, action: Callable[[], dict[str, Any]]) -> dict[str, Any] | str:
        try:
            result = action()
        except (ServerDown, NotVramguard, RuntimeError) as exc:
            return f"Could not do that: {exc}"
        self._poll()  # show the action's effect now, not at the next sample
        return result

    # -- the server process ----------------------------------------------------------------

    def ensure_server(self) -> None:
        """Start the server now if it is down and this tray may start one."""
        if self.start_server is not None and (self.server is None or
                                              self.server.poll() is not None):
            self.stopped = False
            self.server = self.start_server()
            with self._lock:  # not to be overwritten by a reading of the old server
                self.status = "starting"
            log.info("started the server (pid %d)", self.server.pid)

    def _supervise(self) -> None:
        if self.server is None or self.server.poll() is None:
            return
        code = self.server.returncode
        if code == 0:  # asked to stop (`vramguard stop`, the installer, Ctrl+C): stay down
            with self._lock:
                self.status = "stopped"
            self.last_stop = "the server was asked to stop"
            self.server = None
            self.stopped = True
            return
        if time.monotonic() < self._next_start:
            return
        self.last_stop = f"the server stopped unexpectedly (exit status {code}); restarted"
        log.warning("server exited with status %s; restart %d", code, self.restarts + 1)
        backoff = RESTART_BACKOFF_S[min(self.restarts, len(RESTART_BACKOFF_S) - 1)]
        self.restarts += 1
        self._next_start = time.monotonic() + backoff
        self.ensure_server()

    def stop_server(self) -> None:
        if self.server is not None and self.server.poll() is None:
            try:
                self.client.shutdown()
                self.server.wait(20)
            except (ServerDown, NotVramguard, RuntimeError, subprocess.TimeoutExpired):
                self.server.terminate()
                self.server.wait(10)
