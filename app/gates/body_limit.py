"""ASGI middleware that bounds request bodies: each one, and all of them together.

A declared ``Content-Length`` over the limit is answered with 413 before a
byte of the body is read; a chunked or lying body is cut off as soon as the
bytes received pass the limit. The bytes of all bodies being received or
held by requests in progress are capped too: past the cap, new uploads get
503 with ``Retry-After`` before they are read, so a flood of uploads cannot
fill memory. Refused bodies are read through and dropped chunk by chunk (never
held) so the client gets the answer instead of a reset connection. (One event
loop runs this: no lock is needed.)
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import ApiError, Overloaded, PayloadTooLarge
from app.units import human_bytes

DRAIN_FACTOR = 4  # refused bodies up to 4x the size limit are read through, not reset


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The upload is larger than the {human_bytes(limit)} limit. "
                           "Send a smaller image.")


def too_many_uploads() -> Overloaded:
    return Overloaded("vramguard is receiving too many images at once. Try again shortly.",
                      retry_after=1)


async def refuse(error: ApiError, scope: Scope, receive: Receive, send: Send,
                 declared: int, drain_limit: int) -> None:
    """Answer ``error`` without keeping the body: read it through and drop each chunk.

    Answering while the client is still sending makes the server close the
    connection, and the client sees a reset instead of the answer.
    """
    if declared <= drain_limit:
        while True:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
    await error.response()(scope, receive, send)


def declared_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return max(0, int(value))
            except ValueError:
                return 0
    return 0


class BodySizeLimit:
    """413 for a body over ``max_bytes``; 503 when all bodies in flight would pass
    ``max_inflight_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_inflight_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.inflight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope)
        drain_limit = DRAIN_FACTOR * self.max_bytes
        if declared > self.max_bytes:
            await refuse(too_large(self.max_bytes), scope, receive, send, declared, drain_limit)
            return
        if declared and self.inflight + declared > self.max_inflight_bytes:
            await refuse(too_many_uploads(), scope, receive, send, declared, drain_limit)
            return
        held = declared
        self.inflight += held
        received = 0

        async def limited() -> Message:
            nonlocal received, held
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise too_large(self.max_bytes)
                if received > held:  # no or a too small Content-Length: count as it comes
                    if self.inflight + received - held > self.max_inflight_bytes:
                        raise too_many_uploads()
                    self.inflight += received - held
                    held = received
            return message

        try:
            await self.app(scope, limited, send)
        finally:
            self.inflight -= held
