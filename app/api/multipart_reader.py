"""The image stream's body, read as it arrives: python-multipart's streaming parser turns
each chunk into parts, and each image part (the field ``file``; any other part ends the
body with 400, ``image_field``) is handed to the stream when its headers have arrived, so
that the stream decides when the rest of the body is read. Every byte that no image keeps
is given back to the upload caps as soon as it is parsed (``body_dropped``): memory stays
flat however long the body."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.types import Receive, Scope

from app.errors import ApiError, BadRequest, ClientGone, UnsupportedMediaType
from app.gates.body_limit import body_dropped, too_large

FIELD = b"file"  # the multipart field that holds each image; no other may come


@dataclass
class Part:
    """One image of the stream, from its part's headers to its answer line."""

    index: int
    filename: str
    data: bytearray | None = None  # its bytes so far; None while not taken (or dropped)
    body: asyncio.Future[bytes] = field(default_factory=asyncio.Future)  # all of them


def boundary_of(request: Request) -> bytes:
    """The multipart boundary of the request's Content-Type (415 or 400 without one)."""
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    if ctype.lower() != b"multipart/form-data":
        raise UnsupportedMediaType("Send the images as a multipart/form-data body, each in a "
                                   "field named 'file'.")
    boundary = params.get(b"boundary")
    if not boundary:
        raise BadRequest("The multipart Content-Type has no boundary.")
    return boundary


def image_field(headers: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """The Content-Disposition options of an image part; any other part is refused (400)
    before its bytes are parsed. A skipped part would cost its sender no token and no
    place in line, yet its parsing costs the event loop: every part is an image."""
    _, options = parse_options_header(headers.get(b"content-disposition", b""))
    if options.get(b"name") != FIELD:
        raise BadRequest("Only images can be sent in the stream, each in a field named "
                         "'file'; remove the other fields.")
    return options


class MultipartReader:
    """Reads one multipart body chunk by chunk. ``take(part)`` is awaited when an image
    part's headers have arrived, before any more of the body is parsed; it says whether
    the part's bytes are to be kept. A kept image is held to ``max_image_bytes`` (past it,
    it fails alone) and its bytes end in ``part.body``."""

    def __init__(self, scope: Scope, boundary: bytes, max_image_bytes: int,
                 take: Callable[[Part], Awaitable[bool]]) -> None:
        self.scope = scope
        self.max_image_bytes = max_image_bytes
        self.take = take
        self.events: list[tuple[str, bytes]] = []  # what the parser saw in the last chunk
        self.parser = MultipartParser(boundary, {
            "on_part_begin": lambda: self.events.append(("begin", b"")),
            "on_header_field": self._on("field"),
            "on_header_value": self._on("value"),
            "on_header_end": lambda: self.events.append(("header", b"")),
            "on_headers_finished": lambda: self.events.append(("headers", b"")),
            "on_part_data": self._on("data"),
            "on_part_end": lambda: self.events.append(("end", b"")),
            "on_end": lambda: self.events.append(("done", b"")),
        })
        self.header = [bytearray(), bytearray()]  # the part header being parsed
        self.headers: dict[bytes, bytes] = {}
        self.part: Part | None = None  # the image whose bytes are arriving
        self.parts = 0  # image parts begun
        self.complete = False  # the closing boundary has been parsed

    def _on(self, kind: str) -> Callable[[bytes, int, int], None]:
        return lambda data, start, end: self.events.append((kind, data[start:end]))

    async def read(self, receive: Receive) -> None:
        """Read and parse the body to its end (ClientGone on a hang-up, BadRequest when it
        ends before its closing boundary)."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone("The client disconnected during its image stream.")
            chunk = message.get("body", b"")
            if chunk:
                await self._feed(chunk)
            if not message.get("more_body", False):
                break
        if not self.complete:
            raise BadRequest("The upload ended before the multipart body's closing boundary.")

    def abandon(self, error: ApiError) -> None:
        """The body failed part way: the image being read gets that error."""
        part, self.part = self.part, None
        if part is not None and part.data is not None:
            body_dropped(self.scope, len(part.data))
            part.data = None
            part.body.set_exception(error)

    async def _feed(self, chunk: bytes) -> None:
        """Parse one chunk, then act on what it held, in order; give back every byte of it
        that no image keeps."""
        try:
            self.parser.write(chunk)
        except MultipartParseError as exc:
            raise BadRequest(f"The multipart body is malformed: {exc}") from None
        events, self.events = self.events, []
        kept = 0
        for kind, value in events:
            if kind == "begin":
                self.headers = {}
            elif kind in ("field", "value"):
                self.header[kind == "value"] += value
            elif kind == "header":
                name, text = (bytes(h) for h in self.header)
                self.headers[name.strip().lower()] = text.strip()
                self.header = [bytearray(), bytearray()]
            elif kind == "headers":
                await self._begin()
            elif kind == "data":
                kept += self._data(value)
            elif kind == "end":
                self._end()
            else:
                self.complete = True
        body_dropped(self.scope, len(chunk) - kept)

    async def _begin(self) -> None:
        """A part's headers have arrived: an image, handed to ``take``."""
        options = image_field(self.headers)
        part = Part(self.parts, options.get(b"filename", b"").decode("utf-8", "replace"))
        self.parts += 1
        if await self.take(part):
            part.data = bytearray()
        self.part = part

    def _data(self, value: bytes) -> int:
        """Keep a taken image's bytes (how many were kept); past ``max_image_bytes`` drop
        them and fail the image."""
        part = self.part
        if part is None or part.data is None:
            return 0
        if len(part.data) + len(value) > self.max_image_bytes:
            body_dropped(self.scope, len(part.data))
            part.data = None
            part.body.set_exception(too_large(self.max_image_bytes))
            return 0
        part.data += value
        return len(value)

    def _end(self) -> None:
        part, self.part = self.part, None
        if part is not None and part.data is not None:
            part.body.set_result(bytes(part.data))
            part.data = None
