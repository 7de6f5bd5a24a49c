"""The tray's live line to the server: it follows ``GET /v1/events`` (Server-Sent
Events) in a daemon thread and hands each sample and state change to a listener
the moment it arrives, so the icon never lags the server by a poll.

A stream that drops, stays silent, or a server that is down is retried with
back-off (1, 2, 5, 10 s; from the start once the server accepts the stream). A
stream the server refuses with an HTTP error (too many live views open, rate
limited) sets ``refused``: the listener polls meanwhile, and the stream is tried
again later.

Each connection carries the admin token when ``credentials`` gives one, asked anew
before each: the server keeps a live-view slot for its holder, so a program that opens
streams under ever new client ids cannot push the tray back to polling. What gives it
(the controller) gives only a token the server has just proved it knows, else None: the
stream then goes without, competing for the open slots like any program.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import httpx

from app.schemas import GuardState, LiveSample

log = logging.getLogger("vramguard.tray")
BACKOFF_S = (1.0, 2.0, 5.0, 10.0)
CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 5.0
"""A sample (or, before the model is ready, a heartbeat comment) comes every second;
this long without one means a dead connection."""
_LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class Event:
    kind: str
    data: str


class SseParser:
    """Events out of ``text/event-stream`` text however the network splits it: one
    ``field: value`` per line, an empty line ends the event, ``:`` starts a comment."""

    def __init__(self) -> None:
        self.retry_s: float | None = None  # the server's ``retry:``: wait this long to reconnect
        self._buffer = ""
        self._kind = ""
        self._data: list[str] = []

    def feed(self, chunk: str) -> list[Event]:
        self._buffer += chunk
        events = []
        while match := _LINE_END.search(self._buffer):
            if match.group() == "\r" and match.end() == len(self._buffer):
                break  # maybe the first half of a \r\n split between chunks
            line, self._buffer = self._buffer[:match.start()], self._buffer[match.end():]
            if event := self._line(line):
                events.append(event)
        return events

    def _line(self, line: str) -> Event | None:
        if not line:
            event = Event(self._kind or "message", "\n".join(self._data)) if self._data else None
            self._kind, self._data = "", []
            return event
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._kind = value
        elif name == "data":
            self._data.append(value)
        elif name == "retry" and value.isascii() and value.isdigit():
            self.retry_s = int(value) / 1000
        return None


class Listener(Protocol):
    """What the stream tells (the tray controller); called on the stream's thread."""

    def stream_sample(self, sample: LiveSample) -> None: ...

    def stream_state(self, state: GuardState) -> None: ...

    def stream_lost(self, problem: str) -> None: ...


def deliver(event: Event, listener: Listener) -> None:
    """Hand one event to the listener; one the tray cannot read is logged and skipped."""
    try:
        if event.kind == "sample":
            listener.stream_sample(LiveSample.model_validate_json(event.data))
        elif event.kind == "state":
            listener.stream_state(GuardState(json.loads(event.data)["state"]))
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("ignored a %s event the tray cannot read: %s", event.kind, exc)


class Backoff:
    """Seconds to wait before the next try: longer while tries keep failing, short again
    once the server accepted one (it is up), never shorter than the server asked."""

    def __init__(self) -> None:
        self.failures = 0

    def after(self, accepted: bool, asked_s: float | None = None) -> float:
        if accepted:
            self.failures = 0
        wait = BACKOFF_S[min(self.failures, len(BACKOFF_S) - 1)]
        self.failures += 1
        return max(wait, asked_s or 0.0)


def retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After", "")
    return float(value) if value.isascii() and value.isdigit() else None


class EventStream:
    """Follows the stream from ``start()`` until ``stop()``, on its own connection."""

    def __init__(self, base_url: str, listener: Listener,
                 credentials: Callable[[], str | None],
                 read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.listener = listener
        self.credentials = credentials  # the proven admin token for the next connection
        self.refused = False  # the server answered the stream with an error: poll instead
        self.read_timeout_s = read_timeout_s
        # trust_env=False: straight to the server, never through a proxy of the environment
        # (which would get the admin token; httpx ignores the exceptions for 127.0.0.1).
        self._http = httpx.Client(
            base_url=base_url, timeout=httpx.Timeout(CONNECT_TIMEOUT_S, read=read_timeout_s),
            headers={"X-Client-Id": "vramguard-tray", "Accept": "text/event-stream"},
            trust_env=False)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name="vramguard-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """End the thread now: shutting its socket down wakes a read that is waiting."""
        self._stop.set()
        with self._lock:
            if self._socket is not None:
                with contextlib.suppress(OSError):
                    self._socket.shutdown(socket.SHUT_RDWR)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        backoff = Backoff()
        with self._http:  # closed by this thread: never under a read in progress
            while not self._stop.is_set():
                try:
                    accepted, asked_s = self._follow()
                except Exception:  # a bug must not leave the icon frozen on its last reading
                    log.exception("following the server's events failed")
                    accepted, asked_s = False, None
                self._stop.wait(backoff.after(accepted, asked_s))

    def _follow(self) -> tuple[bool, float | None]:
        """One connection, until it ends: (whether the server accepted it, the seconds it
        asked the tray to wait before the next)."""
        parser = SseParser()
        accepted = False
        token = self.credentials()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            with self._http.stream("GET", "/v1/events", headers=headers) as response:
                if not response.is_success:
                    self.refused = True
                    return False, retry_after(response)
                accepted, self.refused = True, False
                self._hold(response.extensions["network_stream"].get_extra_info("socket"))
                if self._stop.is_set():
                    return True, None
                for chunk in response.iter_text():
                    for event in parser.feed(chunk):
                        deliver(event, self.listener)
            problem = "the server ended its event stream"
        except httpx.ReadTimeout:
            problem = f"no news from the server for {self.read_timeout_s:g} s"
        except httpx.TransportError as exc:
            problem = str(exc) or type(exc).__name__
        finally:
            self._hold(None)
        if not self._stop.is_set():
            self.listener.stream_lost(problem)
        return accepted, parser.retry_s

    def _hold(self, sock: socket.socket | None) -> None:
        with self._lock:
            self._socket = sock
