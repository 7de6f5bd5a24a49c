"""What the tray knows and does, independent of any tray library (tested headless).

It follows the server's event stream (polling once a second only while the
server refuses the stream, or before ``follow()``), turns each sample into an
icon, a tooltip and menu lines, raises one notification per memory episode
and per suspected leak, runs the menu's actions through the API, and
supervises the server process it started: a server that dies is restarted,
and the menu says why it stopped.

It says "vramguard is ready: 127.0.0.1:8765" once per start of the tray, at its first
reading (the server sends readings only once its model is ready). Once per start, not
once per install: a start takes from seconds to minutes (the first), and whoever just
started vramguard cannot tell when it is ready from an icon that may sit in the hidden
part of the tray; a server restarted after a crash is said in the menu instead.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import threading
import time
import webbrowser
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from PIL import Image

from app.host.exit_status import GPU_LOST, STARTUP_FAILURE
from app.host.instance import instance_folder, stop_requested
from app.schemas import GuardState, LiveSample
from app.units import human_bytes
from tray.client import ApiClient, NotVramguard, Refused, ServerDown
from tray.dashboard import DashboardOpener
from tray.event_stream import EventStream
from tray.icon import draw_icon
from tray.support_report import downloads_folder, save_report
from tray.text import (
    GPU_RESTARTED,
    READY,
    STARTING_NOTICE,
    STILL_STARTING,
    SUPPORT_REPORT_SAVED,
    UNLOAD_BUSY,
    UNLOAD_GONE,
    UNLOADED,
    USE_PAGE_DOWN,
    ModelEntry,
    Notifier,
    gauge_of,
    menu_lines,
    model_entries,
    tooltip,
)

log = logging.getLogger("vramguard.tray")
RESTART_BACKOFF_S = (1, 2, 5, 10, 30)
STARTING = "Starting (first start can take a few minutes)"
STOP_COMMAND_WAIT_S = 60  # `vramguard stop` ends a server that takes longer itself


class TrayController:
    def __init__(self, client: ApiClient, notify: Callable[[str], None],
                 start_server: Callable[[], subprocess.Popen[bytes]] | None = None,
                 last_words: Callable[[subprocess.Popen[bytes]], str] | None = None,
                 launched_again: Callable[[], bool] | None = None) -> None:
        self.client = client
        self.notify = notify
        self.start_server = start_server
        self.last_words = last_words or (lambda _process: "")  # why a server process ended
        # whether a second `vramguard run` came while this one holds the launcher lock
        self.launched_again = launched_again or (lambda: False)
        self._said_starting = False  # "vramguard is starting" was said
        self._gpu_restarted = False  # restarted once because the graphics card was lost
        self.shutdown_requested = False  # from now on no exit of the server is a crash
        self._started_at = 0.0  # wall clock: when we started the current server
        self._start_failure: str | None = None  # why the last start failed, if it did
        self.sample: LiveSample | None = None
        self.status = "starting"
        self.server: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.last_stop: str | None = None
        self.stopped = False  # the server we started was stopped on purpose: quit the tray
        self._next_start = 0.0
        self._notifier = Notifier()
        self._announced = False  # "vramguard is ready" was said
        self._lock = threading.Lock()  # the stream's thread and the tray's share the reading
        self._news = threading.Event()
        self._stream: EventStream | None = None

    # -- reading -----------------------------------------------------------------------

    def follow(self) -> None:
        """Follow the server's event stream from now on instead of polling it."""
        if self._stream is None:
            self._stream = EventStream(self.client.base_url, self, self._stream_token)
            self._stream.start()

    def _stream_token(self) -> str | None:
        """The admin token for the next connection of the event stream, which keeps the
        tray a live-view slot, once the server on the port has proved it knows it; None
        when it cannot (down, busy, not ours, no readable token file): the stream then
        goes without, as any program, rather than give the token to the unproven."""
        try:
            return self.client.proven_token()
        except (ServerDown, NotVramguard, RuntimeError) as exc:
            log.debug("the event stream goes without the admin token: %s", exc)
            return None

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
        self._say_start()

    def _say_start(self) -> None:
        """Say at once that vramguard is starting (once per start of the tray: the icon may
        sit in the hidden part of the tray), and answer a second launch, which starts
        nothing, with where the first one is."""
        if not self._said_starting and self._starting():
            self._said_starting = True
            self.notify(STARTING_NOTICE)
        if self.launched_again():
            self.notify(STILL_STARTING if self.down else
                        READY.format(address=urlparse(self.client.base_url).netloc))

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
        notify when memory just got tight or a leak is first suspected."""
        with self._lock:
            self.sample = sample
            if sample is not None:
                self.status = "running"
            elif self.status == "running":
                self.status = f"not answering: {problem}"
            messages = [self._ready_message(sample),
                        self._notifier.update(gauge_of(sample).state)]
            if sample is not None:
                messages.append(self._notifier.leak(sample.leak_suspected,
                                                    sample.leak_growth_bytes))
        for message in messages:
            if message:
                self.notify(message)

    def _ready_message(self, sample: LiveSample | None) -> str | None:
        if sample is None or self._announced:
            return None
        self._announced = True
        return READY.format(address=urlparse(self.client.base_url).netloc)

    def icon(self, size: int = 64) -> Image.Image:
        return draw_icon(gauge_of(self.sample), size)

    def _starting(self) -> bool:
        """The server we started has not answered yet (torch loads gigabytes of libraries,
        which an antivirus scans on the first start)."""
        return (self.sample is None and self.status == "starting" and self.server is not None
                and self.server.poll() is None)

    def tooltip(self) -> str:
        return f"vramguard: {STARTING.lower()}" if self._starting() else tooltip(self.sample)

    def lines(self) -> list[str]:
        with self._lock:
            sample, status = self.sample, self.status
        lines = [STARTING] if self._starting() else menu_lines(sample)
        if sample is None and status not in ("running", "starting"):
            lines.append(f"Why: {status}")
        if self.last_stop:
            lines.append(f"Last stop: {self.last_stop}")
        return lines

    def models(self) -> list[ModelEntry]:
        """The models in memory, as the last sample listed them (none while down)."""
        with self._lock:
            sample = self.sample
        return model_entries(sample)

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

    def unload(self, name: str) -> str:
        """Unload a model now; what to tell the person (a busy model or one already gone is
        said in words of its own)."""
        size = next((human_bytes(entry.weights_bytes) for entry in self.models()
                     if entry.name == name), "its memory")
        refusals = {409: UNLOAD_BUSY.format(name=name), 404: UNLOAD_GONE.format(name=name)}
        result = self._act(lambda: self.client.unload_model(name), refusals)
        return result if isinstance(result, str) else UNLOADED.format(name=name, size=size)

    def open_dashboard(self) -> str | None:
        """Open the dashboard, signed in, in the browser; None when it opened, else what
        to tell the person (nothing is opened for a server that fails the challenge)."""
        opener = DashboardOpener(self.client, instance_folder(self.client.token_file))
        try:
            opener.open()
        except (ServerDown, NotVramguard, RuntimeError) as exc:
            return f"Could not open the dashboard: {exc}"
        return None

    def open_use_page(self) -> str | None:
        """Open "Use it from your app" (``/ui/use``, which holds no secret: no one-time code)
        in the browser; None when it opened, else what to tell the person."""
        if self.down:
            return USE_PAGE_DOWN
        webbrowser.open(f"{self.client.base_url}/ui/use")
        return None

    def save_support_report(self, folder: Path | None = None) -> str:
        """Save the support report (default: in Downloads); what to tell the person."""
        try:
            path = save_report(self.client.support_report, folder or downloads_folder())
        except (ServerDown, NotVramguard, RuntimeError, Refused) as exc:
            return f"Could not save a support report: {exc}"
        except OSError as exc:
            return f"Could not save a support report: {exc.strerror or exc}"
        return SUPPORT_REPORT_SAVED.format(path=path)

    def _act(self, action: Callable[[], dict[str, Any]],
             refusals: dict[int, str] | None = None) -> dict[str, Any] | str:
        """Run an action; its answer, or what to tell the person: ``refusals`` has the
        words for the server's refusals the action expects, by status."""
        try:
            result = action()
        except Refused as exc:
            if refusals and exc.status in refusals:
                self._poll()  # the menu shows what is true now
                return refusals[exc.status]
            return f"Could not do that: {exc}"
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
            self.shutdown_requested = False
            self._started_at = time.time()
            self.server = self.start_server()
            with self._lock:  # not to be overwritten by a reading of the old server
                self.status = "starting"
            log.info("started the server (pid %d)", self.server.pid)

    def request_shutdown(self) -> None:
        """The server is being stopped on purpose (Quit, Ctrl+C, Ctrl+Break, the launcher
        being ended): whatever status it exits with, it stays down."""
        self.shutdown_requested = True

    def _stop_command_running(self) -> bool:
        """`vramguard stop` (or the installer through it) is ending our server."""
        port = urlparse(self.client.base_url).port
        return port is not None and stop_requested(instance_folder(self.client.token_file),
                                                   port, self._started_at)

    def _supervise(self) -> None:
        if self.server is None or self.server.poll() is None:
            return
        code = self.server.returncode
        # Asked to stop (`vramguard stop`, the installer, Ctrl+C): stay down. A stop that
        # had to end the server shows as status 15 on Windows (TerminateProcess), not 0.
        if code == 0 or self.shutdown_requested or self._stop_command_running():
            with self._lock:
                self.status = "stopped"
            self.last_stop = "the server was asked to stop"
            self.server = None
            self.stopped = True
            return
        if code == GPU_LOST and not self._gpu_restarted:
            self._restart_for_the_gpu()
            return
        reason = self.last_words(self.server) or f"exit status {code}"
        with self._lock:
            never_ready = self.status == "starting"
        if code == STARTUP_FAILURE or (never_ready and reason == self._start_failure):
            self._give_up(reason)
            return
        self._start_failure = reason if never_ready else None
        if time.monotonic() < self._next_start:
            return
        self.last_stop = f"the server stopped unexpectedly ({reason}); restarted"
        log.warning("server exited with status %s; restart %d", code, self.restarts + 1)
        backoff = RESTART_BACKOFF_S[min(self.restarts, len(RESTART_BACKOFF_S) - 1)]
        self.restarts += 1
        self._next_start = time.monotonic() + backoff
        self.ensure_server()

    def _restart_for_the_gpu(self) -> None:
        """The server left because the graphics card stopped working (a driver reset or
        update): start a new one at once, once per start of the tray, neither counted as
        a crash nor as a start failure. A second loss is a crash like any other."""
        self._gpu_restarted = True
        log.warning("the server exited because the graphics card stopped working; "
                    "starting it again")
        self.last_stop = "the graphics card stopped working; the server was restarted"
        self.ensure_server()
        self.notify(GPU_RESTARTED)

    def _give_up(self, reason: str) -> None:
        """A start failure that restarting cannot cure (the port is taken, the same error
        again): stay down and say why, instead of restarting it forever."""
        log.error("the server could not start: %s. Not restarting it.", reason)
        with self._lock:
            self.status = f"could not start: {reason}"
        self.last_stop = "the server could not start; fix the cause, then choose Start server"
        self.server = None
        self._start_failure = None
        self.notify(f"vramguard could not start: {reason}")

    def stop_server(self) -> None:
        by_stop_command = self._stop_command_running()
        self.request_shutdown()
        if by_stop_command and self.server is not None:
            # `vramguard stop` is ending it: a second request or a signal would cut its
            # drain short. Waiting keeps its stderr (our pipe) open until it has ended.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.server.wait(STOP_COMMAND_WAIT_S)
            return
        if self.server is not None and self.server.poll() is None:
            try:
                self.client.shutdown()
                self.server.wait(20)
            except (ServerDown, NotVramguard, RuntimeError, subprocess.TimeoutExpired):
                self.server.terminate()
                self.server.wait(10)
