"""The image stream's answer, one JSON line at a time: ``application/x-ndjson``, or each
line as one Server-Sent Event (``data:``) when the client asks for ``text/event-stream``.
The head goes with the first line, so that a failure before any line is still answered
as a plain JSON error."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from starlette.types import Send

from app.errors import ApiError

NDJSON, SSE = "application/x-ndjson", "text/event-stream"


def error_line(error: ApiError) -> dict[str, Any]:
    """An error as a line tells it: code and message, and ``retry_after`` in whole seconds
    (as the Retry-After header says it) when a 503 says when to come back."""
    body: dict[str, Any] = {"code": error.code, "message": error.message}
    if error.retry_after is not None:
        body["retry_after"] = max(1, math.ceil(error.retry_after))
    return body


class LineWriter:
    """Writes the lines that the stream's tasks hand it, one whole line at a time (they
    finish in any order, so the writes take turns)."""

    def __init__(self, send: Send, sse: bool,
                 headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        self.send = send
        self.sse = sse
        self.headers = headers  # the route's own, beside the stream's
        self.head_sent = False
        self._turn = asyncio.Lock()

    async def write(self, line: dict[str, Any]) -> None:
        """Write one line (the answer's head first)."""
        text = json.dumps(line, separators=(",", ":")).encode()
        body = b"data: " + text + b"\n\n" if self.sse else text + b"\n"
        async with self._turn:
            if not self.head_sent:
                self.head_sent = True
                await self.send({"type": "http.response.start", "status": 200, "headers": [
                    (b"content-type", (SSE if self.sse else NDJSON).encode()),
                    (b"cache-control", b"no-store"),
                    # the body may end unread (a failure): never reuse the connection
                    (b"connection", b"close"), *self.headers]})
            await self.send({"type": "http.response.body", "body": body, "more_body": True})

    async def end(self) -> None:
        """End the answer (after its last line)."""
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})
