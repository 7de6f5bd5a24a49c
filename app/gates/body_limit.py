"""ASGI middleware that bounds request bodies: each one, all of them together, each
client's, and how long one may stall.

Bytes are charged as they arrive, never as declared: a client that declares a large
body and sends nothing holds nothing, so idle sockets cannot block other uploads. The
bytes received by requests still in progress are capped in total and per client (the
rate limiter's client); a chunk that would pass a cap gets the upload 503 with
``Retry-After``. A declared ``Content-Length`` over the size limit gets 413 before a
byte is read; a chunked or lying body is cut off as soon as it passes the limit. A body
that makes no progress for ``read_timeout_s`` gets 408 and its connection is closed,
and so does one that arrives slower than its whole-body deadline allows
(``app.gates.upload_deadline``): its place in line and its bytes are given back as the
refusal unwinds the route. Requests without a body pass untouched (a GET that waits for
its client to hang up must not time out).

Only the image routes take uploads; every other route (``/v1/identity`` and
``/v1/ui/session`` take a few dozen bytes of JSON, the rest none) is held to
``SMALL_BODY_BYTES``, so that a route anyone may call cannot be made to wait for a large
body.

The no-progress clock runs only while the app waits in ``receive`` for the next chunk,
so a route that stops reading on purpose is never "stalled" by its own pause; a client
that sends nothing while the route waits for it is.

An image stream (``STREAM_ROUTES``, many images in one body) is held to
``max_stream_bytes`` as a whole (the route holds each image to ``max_bytes``), and its
upload is *paced*: the route gives its bytes back as it drops them (``body_dropped``), so
it holds only the images it has in progress, and a chunk that would pass a cap waits for
bytes to be given back (its own images finishing, or others' uploads) instead of failing
the whole stream at once; after ``read_timeout_s`` of that it is refused like any other.

A refused body is read through and dropped chunk by chunk (never held) before the
answer, so that the client reads the answer instead of a reset connection; if it
stalls meanwhile, the answer closes the connection. (One event loop runs this: no lock
is needed.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from contextlib import suppress

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import Overloaded, PayloadTooLarge, RequestTimeout
from app.gates import refuse
from app.gates.upload_deadline import BodyDeadline, UploadPace
from app.http.scope import IMAGE_ROUTES, OIP_INFER, STREAM_ROUTES, client_key
from app.http.stats import RequestStats
from app.units import human_bytes

DRAIN_FACTOR = 4  # refused bodies up to 4x the size limit are read through, not reset
SMALL_BODY_BYTES = 1024  # the most a route that takes no upload reads (a nonce is 77 bytes)
CLOSE = (b"connection", b"close")
UPLOAD_KEY = "vramguard.upload"  # the request's Upload, in its ASGI scope, for body_done


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The upload is larger than the {human_bytes(limit)} limit. "
                           "Send a smaller image.")


def stream_too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The image stream is larger than the {human_bytes(limit)} limit "
                           "(max_stream_bytes). Send its images in more than one request.")


def too_many_uploads() -> Overloaded:
    return Overloaded("vramguard is receiving too many images at once. Try again shortly.",
                      retry_after=1)


def too_many_from_client() -> Overloaded:
    return Overloaded("This program is sending too many images at once. Wait for its "
                      "earlier uploads to finish, then try again.", retry_after=1)


def not_an_upload(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"This request may carry at most {human_bytes(limit)}: only "
                           "/v1/classify, /v1/embed, /v1/classify/stream and /v2 infer take "
                           "images.")


def stalled(timeout_s: float) -> RequestTimeout:
    return RequestTimeout(f"The upload stopped arriving: nothing came for {timeout_s:g} "
                          "seconds. Check the connection and send the image again.")


def declared_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return max(0, int(value))
            except ValueError:
                return 0
    return 0


def has_body(scope: Scope) -> bool:
    """A request has a body only with a Content-Length above 0 or a Transfer-Encoding
    (HTTP/1.1); any other is left alone."""
    return declared_length(scope) > 0 or any(name == b"transfer-encoding"
                                             for name, _ in scope["headers"])


class BodySizeLimit:
    """413 for a body over ``max_bytes`` (``max_stream_bytes`` for an image stream,
    ``SMALL_BODY_BYTES`` for a route that takes no upload); 503 when the bytes received by
    requests in progress would pass ``max_inflight_bytes``, or ``max_client_bytes`` for one
    client; 408 when a body stalls for ``read_timeout_s`` or arrives slower than ``pace``
    allows (None: no whole-body deadline). Its own refusals are counted in ``stats``; those
    raised while a route reads the body are the app's to answer."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_inflight_bytes: int,
                 max_client_bytes: int, read_timeout_s: float, stats: RequestStats,
                 max_stream_bytes: int | None = None, pace: UploadPace | None = None) -> None:
        self.app = app
        self.pace = pace
        self.max_bytes = max_bytes
        self.max_stream_bytes = max_stream_bytes or max_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.max_client_bytes = max_client_bytes
        self.read_timeout_s = read_timeout_s
        self.stats = stats
        self.inflight = 0
        self.by_client: dict[str, int] = {}  # only clients holding bytes now
        self._room: set[asyncio.Future[None]] = set()  # paced uploads waiting to be charged

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not has_body(scope):
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope)
        paced = scope["path"] in STREAM_ROUTES
        upload = Upload(self, client_key(scope), receive, send, self.allowance(scope), paced)
        if declared > upload.limit:
            if declared <= upload.drain_limit:
                await upload.drain()
            await refuse(upload.too_large(), self.stats, scope, receive, upload.send)
            return
        scope[UPLOAD_KEY] = upload
        try:
            await self.app(scope, upload.receive, upload.send)
        finally:
            self.release(upload)

    def allowance(self, scope: Scope) -> int:
        """The most body bytes the request's route reads."""
        path = scope["path"]
        if path in STREAM_ROUTES:
            return self.max_stream_bytes
        if path in IMAGE_ROUTES or OIP_INFER.match(path):
            return self.max_bytes
        return min(SMALL_BODY_BYTES, self.max_bytes)

    def charge(self, upload: Upload, size: int) -> Overloaded | None:
        """Count ``size`` more bytes held by ``upload``, or say which cap it would pass."""
        if self.inflight + size > self.max_inflight_bytes:
            return too_many_uploads()
        held = self.by_client.get(upload.client, 0)
        if held + size > self.max_client_bytes:
            return too_many_from_client()
        self.inflight += size
        self.by_client[upload.client] = held + size
        upload.charged += size
        return None

    async def charge_when_room(self, upload: Upload, size: int) -> Overloaded | None:
        """Charge a paced upload's chunk, waiting up to ``read_timeout_s`` for bytes to be
        given back while it does not fit; then say which cap it would pass."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.read_timeout_s
        while (refusal := self.charge(upload, size)) is not None:
            left = give_up - loop.time()
            if left <= 0:
                return refusal
            waiter = loop.create_future()
            self._room.add(waiter)
            try:
                await asyncio.wait_for(waiter, left)
            except TimeoutError:
                pass
            finally:
                self._room.discard(waiter)
        return None

    def give_back(self, upload: Upload, size: int) -> None:
        """Stop counting ``size`` of the bytes ``upload`` holds (at most all of them), and
        wake the paced uploads waiting for room."""
        size = min(size, upload.charged)
        if size <= 0:
            return
        self.inflight -= size
        left = self.by_client[upload.client] - size
        if left:
            self.by_client[upload.client] = left
        else:
            del self.by_client[upload.client]
        upload.charged -= size
        for waiter in self._room:
            if not waiter.done():
                waiter.set_result(None)

    def release(self, upload: Upload) -> None:
        """Give back what ``upload`` held: its request has ended (answered, failed or
        cancelled), so nothing holds its bytes any more."""
        self.give_back(upload, upload.charged)


def body_done(scope: Scope) -> None:
    """A route has turned the body into something smaller (decoded pixels) and dropped it:
    give its bytes back now rather than when the answer goes, so that images waiting for
    the model do not hold the upload budget that the next uploads need."""
    upload = scope.get(UPLOAD_KEY)
    if isinstance(upload, Upload) and upload.ended:
        upload.gate.release(upload)


def body_dropped(scope: Scope, size: int) -> None:
    """A route that reads its body piece by piece (the image stream) has dropped ``size``
    bytes of it (multipart framing once parsed, an image once decoded): give them back now,
    so that a long stream holds only what it has in progress."""
    upload = scope.get(UPLOAD_KEY)
    if isinstance(upload, Upload):
        upload.gate.give_back(upload, size)


class Upload:
    """One request's body as it arrives: each chunk charged to the totals (``paced``: when
    there is room), each wait for the next chunk timed and all of them held to the
    whole-body deadline, the whole held to ``limit``, and ``Connection: close`` on the
    answer if the body stalled or came too slowly."""

    def __init__(self, gate: BodySizeLimit, client: str, receive: Receive, send: Send,
                 limit: int, paced: bool = False) -> None:
        self.gate = gate
        self.client = client
        self.limit = limit
        self.paced = paced
        self._receive = receive
        self._send = send
        self.received = 0  # body bytes so far, kept or dropped
        self.charged = 0  # of those, the ones passed on, held until the request ends
        self.ended = False  # the last chunk (or a disconnect) has come
        self.stalled = False
        self.cut: RequestTimeout | None = None  # why the body was cut off, once it was
        self.deadline = BodyDeadline(gate.pace) if gate.pace is not None else None

    @property
    def drain_limit(self) -> int:
        """The most of a refused body read through before answering."""
        return DRAIN_FACTOR * min(self.limit, self.gate.max_bytes)

    async def _next(self) -> Message:
        """The next message; RequestTimeout if the body makes no progress in time or passes
        its whole-body deadline (and at every later read: a cut body is over). Once the
        body has ended only a disconnect can come, and waiting for it is not a stall."""
        if self.ended:
            return await self._receive()
        if self.cut is not None:
            raise self.cut
        wait_s = self.gate.read_timeout_s
        left_s = wait_s if self.deadline is None else self.deadline.left_s(self.received)
        try:
            async with asyncio.timeout(max(0.0, min(wait_s, left_s))):
                message = await self._timed(self._receive())
        except TimeoutError:
            self.stalled = True
            self.cut = (stalled(wait_s) if self.deadline is None or wait_s <= left_s
                        else self.deadline.too_slow(self.received))
            raise self.cut from None
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.ended = True
        return message

    async def receive(self) -> Message:
        """What the app reads: the body, cut off past the size limit, refused past a cap."""
        message = await self._next()
        if self.received > self.limit:
            raise self.too_large()
        size = len(message.get("body", b""))
        refusal = None
        if size:
            refusal = (await self.gate.charge_when_room(self, size) if self.paced
                       else self.gate.charge(self, size))
        if refusal is not None:
            await self.drain()
            raise refusal
        return message

    async def _timed(self, waiting: Awaitable[Message]) -> Message:
        """``waiting``, its time counted against the whole-body deadline (if any)."""
        if self.deadline is None:
            return await waiting
        with self.deadline.waiting():
            return await waiting

    def too_large(self) -> PayloadTooLarge:
        if self.paced:
            return stream_too_large(self.limit)
        if self.limit < self.gate.max_bytes:
            return not_an_upload(self.limit)
        return too_large(self.limit)

    async def drain(self) -> None:
        """Read the rest of the body and drop it, up to ``drain_limit``; a stall or the
        whole-body deadline ends it (the answer then closes the connection)."""
        with suppress(RequestTimeout):
            while not self.ended and self.received <= self.drain_limit:
                await self._next()

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start" and self.stalled:
            message = {**message, "headers": [*message.get("headers", []), CLOSE]}
        await self._send(message)
