"""Limits on connections that uvicorn does not have: a cap on open connections answered
with the usual JSON 503, a share of it kept for the health checks and the token's or
key's holders, a deadline for receiving each request head (a silent or slowloris
connection is closed), and the open-files limit raised at start.

The share: the cap acts when a connection is made, before its head is read, so it cannot
tell who is calling. Everyone may use ``open_to_all`` of the ``max_connections``; past
that, a connection is let in for its request head only, and that head decides
(``app/http/connection_share.py``): a health check or a caller with the admin token, a
dashboard session or the API key is served, then the connection is closed; anyone else
gets the 503 at once. A connection past everyone's part that has sent no head yet is the
first to go when the whole cap is reached: the next connection takes its place, so
silent sockets cannot hold the share either.

uvicorn closes an idle connection only after a response (its keep-alive timer), never a
fresh one that sends nothing or a head that trickles in; its own ``limit_concurrency``
answers in plain text without Retry-After, and only once a request head has arrived.

An answer given before its request's body has arrived (a 429, the 503 the queue gives
before the upload, a 404) leaves the rest of that body to come. Where its length is known
(``Content-Length``, as nearly every client sends) and within ``max_body_bytes``, the rest
is *skipped* below HTTP: read into a buffer no one looks at, nothing parsed, and the
connection then serves the next request as usual; it must arrive at the upload pace
(``upload_grace_s`` plus its bytes at ``min_upload_bytes_per_s``), or the connection is
closed. Otherwise (a chunked body, a larger one declared), an error answer says
``Connection: close`` and the connection ends by a *lingering close*: the server stops
writing, drops what still arrives, and closes when the client hangs up, at most
``BODY_LINGER_S`` later. Parsed, the unwanted body would cost more than the refusal;
closed at once with it unread, the kernel would reset the connection, and a client that
writes its whole body before reading (most do) would lose the answer.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from app.errors import Overloaded
from app.gates.upload_deadline import UploadPace
from app.http.connection_share import OneAnswer, Trusted, health_check
from app.http.stats import RequestStats

log = logging.getLogger("vramguard.connections")
RETRY_AFTER_S = 1  # most connections end within a second, the rest by the timeouts
LINGER_S = 0.5  # how long a refused connection may take to read its answer and hang up
BODY_LINGER_S = 2.0  # how long the rest of a body answered early may take to arrive
CLOSE = (b"connection", b"close")
FILES_RESERVE = 64  # file handles kept for the log, the cache, the model, refusals…
FILES_RESERVE_SHARE = 4  # …or a quarter of the limit, whichever is more
MIN_CONNECTIONS = 8
SHARE_DIVISOR = 16  # a sixteenth of the cap is kept for health checks and trusted callers…
MIN_SHARE = 2  # …at least this many, and never more than half of it
NO_RLIMIT_TARGET = 65536  # when the hard limit is "unlimited", ask for this many
# accept() failures after which asyncio pauses accepting for a second
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float
    pace: UploadPace  # the rest of a body answered early must come at least this fast…
    max_skip_bytes: int  # …and be no larger than an upload may be (max_body_bytes)

    @property
    def open_to_all(self) -> int:
        """Connections anyone may hold; the rest of the cap is the kept share."""
        share = min(self.max_connections // 2,
                    max(MIN_SHARE, self.max_connections // SHARE_DIVISOR))
        return self.max_connections - share


def raise_open_files_limit() -> tuple[int, int] | None:
    """Raise the soft open-files limit to the hard one: every connection holds a file
    handle, and the soft limit is often low (1024 on Linux, 256 on macOS). Return the
    soft limit (before, after); None where there is no such limit (Windows)."""
    if sys.platform == "win32":
        return None
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = NO_RLIMIT_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:  # macOS caps it below "unlimited"
            log.info("cannot raise the open-files limit from %d to %d: %s", soft, target, exc)
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_cap(wanted: int, open_files: int | None) -> int:
    """`wanted`, or fewer when the open-files limit would run out first: accept() failing
    for lack of file handles leaves a client hanging, while the cap answers it."""
    if open_files is None:
        return wanted
    reserve = max(FILES_RESERVE, open_files // FILES_RESERVE_SHARE)
    return min(wanted, max(MIN_CONNECTIONS, open_files - reserve))


def connection_limits(max_connections: int, header_timeout_s: float, pace: UploadPace,
                      max_skip_bytes: int) -> ConnectionLimits:
    """At start: raise the open-files limit, fit the cap under it, and say so in the log."""
    raised = raise_open_files_limit()
    open_files = raised[1] if raised else None
    if raised and raised[1] > raised[0]:
        log.info("open-files limit raised from %d to %d", *raised)
    cap = connection_cap(max_connections, open_files)
    if cap < max_connections:
        log.warning("the open-files limit (%s) leaves room for %d connections at once, not "
                    "max_connections=%d; raise it ('ulimit -n') to allow more", open_files,
                    cap, max_connections)
    return ConnectionLimits(cap, header_timeout_s, pace, max_skip_bytes)


class _Listener(socket.socket):
    """A listening socket whose accept(), right after failing for lack of file handles,
    once says "nothing to accept". asyncio (3.11) does not stop after that failure: it
    calls accept() again up to `backlog` times in the same round, logging each failure
    and scheduling one more retry for each, which snowballed to 294,136 errors in 15 s.
    Stopped here, a round logs one error and asyncio retries a second later.

    Only the selector loop calls this accept(). Windows' Proactor loop accepts with
    AcceptEx on the socket's handle and never does; there the bound on open handles is
    the connection cap alone (``GuardedH11Protocol.connection_made``, on every loop):
    Windows has no per-process open-files limit to run out of (``connection_cap`` keeps
    ``max_connections`` as it is), so a round of failing accepts cannot start there."""

    _out_of_resources = False

    def accept(self) -> tuple[socket.socket, Any]:
        if self._out_of_resources:
            self._out_of_resources = False
            raise BlockingIOError(errno.EAGAIN, "out of file handles; retried in a moment")
        try:
            connection, address = super().accept()
        except OSError as exc:
            self._out_of_resources = exc.errno in OUT_OF_RESOURCES
            raise
        return connection, address


def no_delay(transport: asyncio.BaseTransport) -> None:
    """Turn Nagle's algorithm off for this connection, whichever loop made it. asyncio
    does so only for sockets made with proto=IPPROTO_TCP, which create_server's are not;
    left on, every small answer waits for the client's delayed ACK (40 ms on Linux).
    Set here, not at accept(), which the Proactor loop (Windows) never calls."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:  # already reset by the client
            log.debug("could not turn Nagle's algorithm off: %s", exc)


def listening_socket(host: str, port: int) -> socket.socket:
    """The socket to give uvicorn (``sockets=``), bound to `host`:`port`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bound = socket.create_server((host, port), family=family)
    log.info("listening on http://%s:%d", f"[{host}]" if ":" in host else host, port)
    return _Listener(bound.family, bound.type, bound.proto, fileno=bound.detach())


def too_many_connections() -> Overloaded:
    return Overloaded("vramguard has too many connections open right now. Try again in a "
                      "moment; if this keeps happening, a program on this computer may be "
                      "opening connections without closing them.", retry_after=RETRY_AFTER_S)


def refused_past_share() -> Overloaded:
    log.warning("refused a connection: everyone's part of max_connections is in use, and "
                "the rest is kept for health checks and callers with the token or key")
    return too_many_connections()


def overloaded_response() -> bytes:
    """A whole HTTP/1.1 503 with the API's JSON error body, written before any request is
    read: a client over the cap gets the same answer as any other overload."""
    response = too_many_connections().response()
    head = [b"HTTP/1.1 503 Service Unavailable",
            *(name + b": " + value for name, value in response.raw_headers),
            b"connection: close"]
    return b"\r\n".join(head) + b"\r\n\r\n" + response.body


class _Refusal(asyncio.Protocol):
    """A connection over the cap: answer at once, stop writing, then read and drop what
    the client still sends until it hangs up (closing with unread data would reset the
    connection and could destroy the answer before the client reads it), at most
    LINGER_S."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self.answer)
        if transport.can_write_eof():
            transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request is not needed: the answer is already sent

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()


_SINK = memoryview(bytearray(256 * 1024))  # where unwanted bodies are read; never looked at


class _Dropped(asyncio.BufferedProtocol):
    """A connection in its lingering close: what arrives is read into ``_SINK`` (no bytes
    allocated, nothing parsed), and its end reaches the HTTP protocol it came from."""

    def __init__(self, owner: asyncio.BaseProtocol) -> None:
        self.owner = owner

    def get_buffer(self, sizehint: int) -> memoryview:
        return _SINK

    def buffer_updated(self, nbytes: int) -> None:
        pass

    def eof_received(self) -> None:
        return None  # the client has sent everything: the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.connection_lost(exc)


class _Skipped(_Dropped):
    """The rest of a body already answered, ``left`` bytes, read into ``_SINK``; then the
    connection goes back to its HTTP protocol with whatever followed (a next request)."""

    def __init__(self, owner: GuardedH11Protocol, left: int) -> None:
        super().__init__(owner)
        self.protocol = owner
        self.left = left

    def buffer_updated(self, nbytes: int) -> None:
        if nbytes < self.left:
            self.left -= nbytes
            return
        after = bytes(_SINK[self.left:nbytes])
        self.left = 0
        self.protocol.skipped(after)


def _body_left(conn: h11.Connection) -> int | None:
    """Bytes of the request's body still to come, where its length is known: a
    ``Content-Length`` body wholly parsed so far. h11 keeps the count in its reader, not
    in its public API: where that changes, None, and the connection closes instead."""
    reader = getattr(conn, "_reader", None)
    left = getattr(reader, "_remaining", None)
    if type(reader).__name__ != "ContentLengthReader" or not isinstance(left, int):
        return None
    return left if not conn.trailing_data[0] else None


class _OnePacket:
    """The connection's transport as uvicorn sees it: what is written in one turn of the
    event loop leaves together at its end. With Nagle's algorithm off, every write is its
    own packet and wake-up for the client, and a response's head and body are two writes
    (a sixth of the CPU a refusal costs went to the second one)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                 close: Callable[[], None]) -> None:
        self._transport = transport
        self._loop = loop
        self._close = close
        self._held: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(bytes(data))

    def flush(self) -> None:
        held, self._held = self._held, []
        if held and not self._transport.is_closing():
            self._transport.write(b"".join(held))

    def close(self) -> None:
        self.flush()
        self._close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._held = []
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol plus the cap and its kept share, the request-head
    deadline and one packet per response. Make one with `guarded_protocol`; uvicorn's
    keep-alive timer is still the idle timeout."""

    limits: ClassVar[ConnectionLimits]
    stats: ClassVar[RequestStats]
    share: ClassVar[OneAnswer]
    answer_overloaded: ClassVar[bytes]
    # connections past everyone's part that have sent no request head, oldest first
    heads_due: ClassVar[dict[GuardedH11Protocol, None]]
    _head_timer: asyncio.TimerHandle | None = None
    _linger_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn's own
        no_delay(transport)
        open_now = len(self.connections)
        if open_now >= self.limits.max_connections and not self._make_room():
            log.warning("refused a connection: %d are open, the most allowed at once "
                        "(max_connections)", open_now)
            self.stats.count(Overloaded.code)
            refusal = _Refusal(self.answer_overloaded)
            transport.set_protocol(refusal)
            refusal.connection_made(transport)
            return
        super().connection_made(transport)
        self._raw = transport
        self.transport = cast(asyncio.Transport, _OnePacket(
            transport, self.loop, functools.partial(self._close, transport)))
        self.app = self._closing_unread(self.app)
        if open_now >= self.limits.open_to_all:
            self.app = self.share.around(self.app)
            self.heads_due[self] = None
        self._watch_head()

    def _make_room(self) -> bool:
        """Close the oldest connection past everyone's part that has sent no head yet,
        with the 503 (False: there is none)."""
        for waiting in self.heads_due:
            del self.heads_due[waiting]
            log.warning("refused a connection: %d are open, the most allowed at once "
                        "(max_connections); closed one that had sent no request yet",
                        len(self.connections))
            self.stats.count(Overloaded.code)
            waiting.transport.write(self.answer_overloaded)
            waiting.transport.close()
            return True
        return False

    def _body_pending(self) -> bool:
        """The request's body is still arriving (always False between requests)."""
        return self.conn.their_state is h11.SEND_BODY

    def _skippable(self) -> int | None:
        """The bytes left of a body still arriving, if they may be skipped: a known length,
        no more than an upload may be (a larger one declared got 413: closed instead)."""
        left = _body_left(self.conn) if self._body_pending() else None
        return left if left is not None and left <= self.limits.max_skip_bytes else None

    def _closing_unread(self, app: ASGIApp) -> ASGIApp:
        """`app`, its error answers given while a body of unknown length is still
        arriving marked ``Connection: close``: the connection ends with them (``_close``)."""

        async def app_closing_unread(scope: Scope, receive: Receive, send: Send) -> None:
            async def answer(message: Message) -> None:
                if (message["type"] == "http.response.start" and message["status"] >= 400
                        and self._body_pending() and self._skippable() is None
                        and CLOSE not in (headers := list(message.get("headers", ())))):
                    message = {**message, "headers": [*headers, CLOSE]}
                await send(message)

            await app(scope, receive, answer)

        return app_closing_unread

    def _close(self, transport: asyncio.Transport) -> None:
        """uvicorn closing the connection: a lingering close while the body still comes
        (stop writing; what arrives goes to ``_Dropped`` until the client hangs up, which
        closes the transport, or BODY_LINGER_S), else at once."""
        if not self._body_pending() or not transport.can_write_eof() or transport.is_closing():
            transport.close()
            return
        if self._linger_timer is None:
            transport.write_eof()
            transport.set_protocol(_Dropped(self))
            transport.resume_reading()
            self._linger_timer = self.loop.call_later(BODY_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None:
            self.heads_due.pop(self, None)
        self._watch_head()

    def on_response_complete(self) -> None:
        left = self._skippable()
        if left is not None and not self.transport.is_closing() and self._linger_timer is None:
            transport = self._raw
            transport.set_protocol(_Skipped(self, left))
            self._linger_timer = self.loop.call_later(
                self.limits.pace.allowed_s(left), transport.close)
        super().on_response_complete()  # resumes reading, starts the idle timer
        self._watch_head()

    def skipped(self, after: bytes) -> None:
        """The rest of an answered body has been skipped: back to HTTP, with a parser that
        starts at the next request, and what followed the body."""
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        size = self.config.h11_max_incomplete_event_size
        self.conn = (h11.Connection(h11.SERVER) if size is None
                     else h11.Connection(h11.SERVER, size))
        self._raw.set_protocol(self)
        if after:
            self.data_received(after)
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        self.heads_due.pop(self, None)
        super().connection_lost(exc)

    def _watch_head(self) -> None:
        """Run the head deadline while the connection waits for a request head and
        uvicorn's keep-alive timer is not counting: from the connection's start, or from
        the first byte after a response. It is a total: bytes that trickle in do not
        restart it. A request handed to the app stops it.

        The rest of a body the app answered without reading (a 404 before the upload) is
        the old request's, not a new head; uvicorn stops its idle timer at those bytes.
        Once the body has all arrived and nothing of a next head has, the connection is
        idle again and gets the idle timer back: cut at the shorter head deadline, a
        client reusing it a moment later would find it closed without an answer."""
        waiting = ((self.cycle is None or self.cycle.response_complete)
                   and self.timeout_keep_alive_task is None
                   and not self.transport.is_closing())
        if not waiting:
            self._stop_head_timer()
        elif self.cycle is not None and self._idle():
            self._stop_head_timer()
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler)
        elif self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s,
                                                    self._head_timed_out)

    def _idle(self) -> bool:
        """Between requests with nothing of the next one received."""
        return self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        log.debug("closed a connection that sent no complete request head in %s s",
                  self.limits.header_timeout_s)
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits, stats: RequestStats,
                     trusted: Trusted = health_check) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn (``http=``), holding these limits; `trusted`
    says which requests the kept share serves (``connection_share.trusted_caller``);
    refusals are counted in `stats` (/v1/stats) like any other 503."""

    class Guarded(GuardedH11Protocol):
        pass

    Guarded.limits = limits
    Guarded.stats = stats
    Guarded.share = OneAnswer(trusted, refused_past_share, stats)
    Guarded.answer_overloaded = overloaded_response()
    Guarded.heads_due = {}
    return Guarded
