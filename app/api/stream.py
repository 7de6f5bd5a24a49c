"""``POST /v1/classify/stream``: many images in one multipart request, one answer line per
image as soon as it is done (completion order), the body read only as fast as the images
are answered.

Why a stream: a folder sent as one request per image pays the HTTP, gate and admission
cost once per image and leaves the pacing to the client; a stream lets the server pace
the upload. Each image still goes the ``/v1/classify`` way (``image_flow``) and gets what
``/v1/classify`` would answer for it, on its own line; one bad image never ends the stream.

- Framing: ``application/x-ndjson`` (or ``text/event-stream`` when the Accept header asks
  for it, each line as one ``data:`` event): ``{"index", "filename", "result": {the
  /v1/classify answer}}`` or ``{"index", "filename", "error": {"code", "message"}}``
  (``retry_after`` too when a 503 says when to come back), then, if the body itself
  failed, ``{"error": {...}}`` without an index, and last ``{"summary": {...}}``. The
  answer starts with the first line; a failure before any line is a plain JSON error.
- Backpressure: at most ``window`` images (twice the model's batch size in force: one
  batch running, the next one filling) are in progress per stream. The next part is taken
  from the body only when one of them is done and it has a place in line
  (``engine.admit``; while the line is full, it waits for room up to ``request_timeout_s``
  and then gets ``overloaded``) and a rate-limit token (one per image: see
  ``app.gates.rate_limit``). The body is parsed as it arrives by python-multipart's
  streaming parser; its bytes are given back to the upload caps as soon as they are
  parsed (framing) or decoded (images, ``body_dropped``): memory stays flat however long
  the stream. Each image is held to ``max_body_bytes``; the body to ``max_stream_bytes``
  (``app.gates.body_limit``). The stall timeout runs only while the route waits for
  bytes, never during these pauses.
- Hang-up: the client is noticed gone at the next read of the body (or, once the body
  has ended, at once); the images in progress are then cancelled (queued ones withdrawn,
  as ``/v1/classify`` does) and the rest of the body is never read.
- Clients that read the answer only after sending the whole body (httpx, requests) see
  their lines at the end; past a few tens of thousands of images the unread lines fill
  the socket buffers and the stream stops until the client reads. Read while sending
  (aiohttp, curl, ``vramguard classify``) or send a few thousand images per request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app.api.classify import ERRORS, classification
from app.api.image_flow import KeepAlive, ModelQuery, Served, TopK, answer, prepare
from app.engine.batcher import Reservation
from app.engine.predictor import CLASSIFY, EMBED
from app.errors import (
    ApiError,
    BadRequest,
    ClientGone,
    InternalError,
    Overloaded,
    UnsupportedMediaType,
)
from app.gates.body_limit import body_dropped, too_large
from app.gates.rate_limit import TOKEN_KEY, Decision
from app.http.state import state_of
from app.models import LoadedModel

log = logging.getLogger("vramguard.stream")
router = APIRouter()
PATH = "/v1/classify/stream"
NDJSON, SSE = "application/x-ndjson", "text/event-stream"
ROOM_POLL_S = 0.05  # a part refused a place in line asks again this often
FIELD = b"file"  # the multipart field that holds each image; others are skipped
BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {"multipart/form-data": {"schema": {
            "type": "object", "required": ["file"],
            "properties": {"file": {"type": "array",
                                    "items": {"type": "string", "format": "binary"}}}}}},
    }
}
DESCRIPTION = """Many images in one multipart body (each in a field `file`, with its
filename); the answer is one JSON line per image as soon as it is done (completion order):
`{"index", "filename", "result": {the /v1/classify answer}}` or `{"index", "filename",
"error": {"code", "message"}}` (with `retry_after` when a 503 says when to come back), as
/v1/classify would answer that image alone. Then, if the body itself failed (stalled, over
`max_stream_bytes`, malformed), `{"error": {...}}`, and last `{"summary": {"images", "ok",
"failed", "seconds"}}`. `Accept: text/event-stream` gets each line as a Server-Sent Event.

The body is read only as fast as images are answered (at most twice the model's batch
size in progress); each image takes a place in line and one rate-limit token before its
bytes are read, and is held to `max_body_bytes`. A client that hangs up cancels the images
in progress. Clients that read the answer only after sending the whole body (httpx,
requests) get the lines at the end: send a few thousand images per request."""
LINES = {"type": "object", "description": "One JSON object per image (completion order), "
         "then a summary; see the route's description."}
STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    200: {"description": "One line per image as each is done, then a summary.",
          "content": {NDJSON: {"schema": LINES}, SSE: {"schema": {"type": "string"}}}},
}


def _error(error: ApiError) -> dict[str, Any]:
    body: dict[str, Any] = {"code": error.code, "message": error.message}
    if error.retry_after is not None:  # whole seconds, as the Retry-After header says
        body["retry_after"] = max(1, math.ceil(error.retry_after))
    return body


@dataclass
class Part:
    """One image of the stream, from its part's headers to its answer line."""

    index: int
    filename: str
    started: float = 0.0  # when it got its place in line (its own clock starts)
    data: bytearray | None = None  # its bytes so far; None while not taken (or dropped)
    body: asyncio.Future[bytes] = field(default_factory=asyncio.Future)  # all of them


@dataclass(frozen=True)
class Options:
    """What the query asked for, the same for every image of the stream."""

    model: str | None
    keep_alive_s: float | None
    top_k: int
    embed: bool


class StreamRun:
    """One stream: reads the body part by part, runs each image as a task, writes lines."""

    def __init__(self, request: Request, options: Options, boundary: bytes, sse: bool) -> None:
        self.request = request
        self.state = state_of(request)
        self.options = options
        self.sse = sse
        self.timeout_s = self.state.settings.request_timeout_s
        self.max_image_bytes = int(self.state.settings.max_body_bytes)
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
        self.parts = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.ok = self.failed = 0
        self.complete = False  # the closing boundary has been parsed
        self.started = time.perf_counter()
        self.head_sent = False
        self.write = asyncio.Lock()
        self.send: Send | None = None

    def _on(self, kind: str) -> Callable[[bytes, int, int], None]:
        return lambda data, start, end: self.events.append((kind, data[start:end]))

    async def __call__(self, receive: Receive, send: Send) -> None:
        self.send = send
        stream_error: ApiError | None = None
        try:
            try:
                await self._read(receive)
            except ClientGone:
                raise
            except ApiError as error:  # the body itself failed: stalled, too large, garbled
                stream_error = error
                self._abandon(error)
            await self._settle(receive if stream_error is None else None)
        except ClientGone as gone:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            if not self.head_sent:
                raise  # answered (to no one) and counted as /v1/classify does
            self.state.stats.count(gone.code)
            return
        if not self.head_sent:
            raise stream_error or BadRequest("The multipart upload has no image: put each "
                                             "in a field named 'file'.")
        if stream_error is not None:
            self.state.stats.count(stream_error.code)
            await self._emit({"error": _error(stream_error)})
        await self._emit({"summary": {"images": self.parts, "ok": self.ok,
                                      "failed": self.failed,
                                      "seconds": round(time.perf_counter() - self.started, 3)}})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _read(self, receive: Receive) -> None:
        """Read and parse the body, starting each image's task as its part begins."""
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
        body_dropped(self.request.scope, len(chunk) - kept)

    async def _begin(self) -> None:
        """A part's headers have arrived: when it is an image, wait until there is room for
        it, then start its task, which takes its place in line before its bytes are kept."""
        _, options = parse_options_header(self.headers.get(b"content-disposition", b""))
        if options.get(b"name") != FIELD:
            return
        part = Part(self.parts, options.get(b"filename", b"").decode("utf-8", "replace"))
        self.parts += 1
        while len(self.tasks) >= self._window():
            await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
        admitted: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(self._image(part, admitted))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if await admitted:
            part.data = bytearray()
        self.part = part

    def _data(self, value: bytes) -> int:
        """Keep a taken image's bytes (how many were kept); past ``max_body_bytes`` drop
        them and fail the image."""
        part = self.part
        if part is None or part.data is None:
            return 0
        if len(part.data) + len(value) > self.max_image_bytes:
            body_dropped(self.request.scope, len(part.data))
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

    def _abandon(self, error: ApiError) -> None:
        """The body failed part way: the image being read gets that error."""
        part, self.part = self.part, None
        if part is not None and part.data is not None:
            body_dropped(self.request.scope, len(part.data))
            part.data = None
            part.body.set_exception(error)

    def _window(self) -> int:
        """Images in progress at most: the model's batch in force twice over."""
        engine = self.state.engine
        try:
            name = self.options.model or engine.settings.model
            return 2 * engine.batcher.lane(name).max_batch
        except KeyError:  # not loaded (yet): its first image loads it
            return 2

    async def _take_token(self) -> None:
        """One rate-limit token per image after the first (the request paid for that),
        waiting for it when there is none: the stream slows to the client's rate."""
        take: Callable[[], Awaitable[Decision]] | None = self.request.scope.get(TOKEN_KEY)
        if take is None:
            return
        while not (decision := await take()).allowed:
            await asyncio.sleep(decision.retry_after)

    async def _place(self, model: str) -> Reservation:
        """A place in line, waiting (up to ``request_timeout_s``) while the line is full."""
        give_up = time.monotonic() + self.timeout_s
        while True:
            try:
                return self.state.engine.admit(self.timeout_s, model)
            except Overloaded:
                if time.monotonic() >= give_up:
                    raise
            others = self.tasks - {asyncio.current_task()}
            if others:  # one of ours finishing frees a place sooner than the poll
                await asyncio.wait(others, timeout=ROOM_POLL_S,
                                   return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(ROOM_POLL_S)

    async def _image(self, part: Part, admitted: asyncio.Future[bool]) -> None:
        """One image: its token, model and place in line (``admitted`` says whether its
        bytes are to be kept), its bytes, then the ``/v1/classify`` path; its line last."""
        line: dict[str, Any] = {"index": part.index, "filename": part.filename}
        try:
            try:
                if part.index:
                    await self._take_token()
                engine, opts = self.state.engine, self.options
                engine.require_unpaused()
                model = (await engine.acquire(opts.model, self.timeout_s,
                                              opts.keep_alive_s)).model
                place = await self._place(model.name)
            except BaseException:
                admitted.set_result(False)
                raise
            with place:
                deadline = time.monotonic() + self.timeout_s
                part.started = time.perf_counter()
                admitted.set_result(True)
                line["result"] = self._result(await self._serve(part, model, place,
                                                                deadline))
            self.ok += 1
        except ApiError as error:
            line["error"] = _error(error)
        except Exception:
            log.exception("image %d of a stream failed", part.index)
            line["error"] = _error(InternalError("Something went wrong inside vramguard. "
                                                 "The details are in its log."))
        if "error" in line:
            self.failed += 1
            self.state.stats.count(line["error"]["code"])
        await self._emit(line)

    async def _serve(self, part: Part, model: LoadedModel, place: Reservation,
                     deadline: float) -> Served:
        data = await part.body
        held = len(data)
        try:
            task = EMBED if self.options.embed else CLASSIFY
            # The cache holds a ranking or features, never both: an embedding stream skips it.
            prepared = await prepare(self.state, model, data, deadline, task,
                                     use_cache=not self.options.embed)
            del data
            body_dropped(self.request.scope, held)
            held = 0
            return await answer(self.request, model, prepared, place, deadline, task,
                                self.options.top_k, part.started, watch=False)
        finally:
            body_dropped(self.request.scope, held)

    def _result(self, served: Served) -> dict[str, Any]:
        result = classification(served, self.options.top_k).model_dump(mode="json")
        if served.embedding is not None:
            result["dimensions"] = len(served.embedding)
            result["embedding"] = [round(float(v), 7) for v in served.embedding]
        return result

    async def _settle(self, receive: Receive | None) -> None:
        """Wait for the images in progress; with ``receive`` (the body has ended, so only
        a hang-up can come), a client that leaves meanwhile cancels them."""
        watch = (asyncio.ensure_future(_hang_up(receive))
                 if receive is not None and self.tasks else None)
        try:
            while self.tasks:
                waiting: set[asyncio.Future[Any]] = {*self.tasks}
                if watch is not None:
                    waiting.add(watch)
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if watch is not None and watch.done():
                    raise ClientGone("The client disconnected during its image stream.")
        finally:
            if watch is not None:
                watch.cancel()

    async def _emit(self, line: dict[str, Any]) -> None:
        """Write one line (the answer's head first)."""
        assert self.send is not None
        text = json.dumps(line, separators=(",", ":")).encode()
        body = b"data: " + text + b"\n\n" if self.sse else text + b"\n"
        async with self.write:
            if not self.head_sent:
                self.head_sent = True
                await self.send({"type": "http.response.start", "status": 200, "headers": [
                    (b"content-type", (SSE if self.sse else NDJSON).encode()),
                    (b"cache-control", b"no-store"),
                    # the body may end unread (a failure): never reuse the connection
                    (b"connection", b"close")]})
            await self.send({"type": "http.response.body", "body": body, "more_body": True})


async def _hang_up(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class ImageStream(Response):
    """The stream's answer: it reads the request's body itself while it writes the lines
    (Starlette's StreamingResponse would read and drop the body, watching for a hang-up)."""

    media_type = NDJSON

    def __init__(self, run: StreamRun) -> None:
        super().__init__(media_type=SSE if run.sse else NDJSON)
        self.run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.run(receive, send)


def _boundary(request: Request) -> bytes:
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    if ctype.lower() != b"multipart/form-data":
        raise UnsupportedMediaType("Send the images as a multipart/form-data body, each in a "
                                   "field named 'file'.")
    boundary = params.get(b"boundary")
    if not boundary:
        raise BadRequest("The multipart Content-Type has no boundary.")
    return boundary


@router.post(PATH, response_class=ImageStream, status_code=200, responses=STREAM_RESPONSES,
             openapi_extra=BODY_DOC, summary="Classify many images in one request",
             description=DESCRIPTION)
async def classify_stream(
    request: Request,
    top_k: TopK = 5,
    model: ModelQuery = None,
    keep_alive: KeepAlive = None,
    embed: Annotated[bool, Query(description="Also each image's features (as /v1/embed "
                                 "gives them), from the same forward pass; not from the "
                                 "result cache.")] = False,
) -> ImageStream:
    boundary = _boundary(request)
    state = state_of(request)
    state.engine.require_unpaused()
    loaded = (await state.engine.acquire(model, state.settings.request_timeout_s,
                                         keep_alive)).model
    if embed and not loaded.feature_dim:
        raise BadRequest(f"The model {loaded.name} cannot give image features; use an "
                         "EfficientNet-Lite model or leave out embed.")
    sse = SSE in request.headers.get("accept", "")
    return ImageStream(StreamRun(request, Options(model, keep_alive, top_k, embed), boundary,
                                 sse))
