"""``POST /v1/classify/stream``: many images in one multipart request, one answer line per
image as soon as it is done (completion order), the body read only as fast as the images
are answered.

Why a stream: a folder sent as one request per image pays the HTTP, gate and admission
cost once per image and leaves the pacing to the client; a stream lets the server pace
the upload. Each image still goes the ``/v1/classify`` way (``image_flow.serve_in_place``)
and gets what ``/v1/classify`` would answer for it, on its own line; one bad image never
ends the stream. This module paces the images; ``multipart_reader`` reads the body and
``stream_lines`` writes the answer.

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
- Only images: every part must be a ``file``; any other ends the body with 400 (a plain
  error before the first line, else the body's error line) before its bytes are parsed.
  A part that is not an image would take no token and no place in line, yet parsing it
  costs the event loop that every client shares; refusing it is simpler than charging it.
  A part's headers are held to python-multipart's limit (4 KiB each, 8 per part: the
  ``python-multipart`` floor in pyproject.toml is the first release with it).
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
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app.api.classify import ERRORS, classification
from app.api.image_flow import (
    Ask,
    KeepAlive,
    ModelQuery,
    Served,
    Threshold,
    TopK,
    after_body,
    check_task,
    find_model,
    find_model_asked,
    serve_in_place,
)
from app.api.keep_alive import HEADER, HEADER_DOC, caller_of, note_text
from app.api.multipart_reader import MultipartReader, Part, boundary_of
from app.api.stream_lines import NDJSON, SSE, LineWriter, error_line
from app.engine.lanes import Reservation
from app.engine.predictor import CLASSIFY, EMBED
from app.errors import ApiError, BadRequest, ClientGone, InternalError, Overloaded
from app.gates.body_limit import body_dropped
from app.gates.rate_limit import Decision
from app.http.scope import TOKEN_KEY
from app.http.state import state_of
from app.models import LoadedModel

log = logging.getLogger("vramguard.stream")
router = APIRouter()
PATH = "/v1/classify/stream"
ROOM_POLL_S = 0.05  # a part refused a place in line asks again this often
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
filename; any other field ends the body with 400); the answer is one JSON line per image
as soon as it is done (completion order): `{"index", "filename", "result": {the
/v1/classify answer}}` or `{"index", "filename", "error": {"code", "message"}}` (with
`retry_after` when a 503 says when to come back), as /v1/classify would answer that image
alone. Then, if the body itself failed (stalled, over `max_stream_bytes`, malformed, a
field that is not `file`), `{"error": {...}}`, and last `{"summary": {"images", "ok",
"failed", "seconds"}}`. `Accept: text/event-stream` gets each line as a Server-Sent Event.

The body is read only as fast as images are answered (at most twice the model's batch
size in progress); each image takes a place in line and one rate-limit token before its
bytes are read, and is held to `max_body_bytes`. A client that hangs up cancels the images
in progress. Clients that read the answer only after sending the whole body (httpx,
requests) get the lines at the end: send a few thousand images per request."""
LINES = {"type": "object", "description": "One JSON object per image (completion order), "
         "then a summary; see the route's description."}
STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {
    # A refusal before the stream has begun is plain JSON, not a line: named as such (a
    # ``model`` here would be documented under the route's own stream media type).
    **{code: {"description": "Refused before the first line",
              "content": {"application/json": {"schema": {
                  "$ref": "#/components/schemas/ErrorResponse"}}}} for code in ERRORS},
    200: {"description": "One line per image as each is done, then a summary.",
          "headers": HEADER_DOC,
          "content": {NDJSON: {"schema": LINES}, SSE: {"schema": {"type": "string"}}}},
}


@dataclass(frozen=True)
class Options:
    """What the query asked for, the same for every image of the stream."""

    model: str | None
    keep_alive_s: float | None
    top_k: int
    embed: bool
    threshold: float | None = None


class StreamRun:
    """One stream: lets the reader take each image part when there is room for it, runs
    each image as a task through ``serve_in_place``, and hands its line to the writer."""

    def __init__(self, request: Request, options: Options, boundary: bytes,
                 lines: LineWriter) -> None:
        self.request = request
        self.state = state_of(request)
        self.caller = caller_of(request)  # each image's load is charged to it
        self.options = options
        # The cache holds a ranking or features, never both: an embedding stream skips it.
        self.ask = Ask(EMBED if options.embed else CLASSIFY, options.top_k,
                       use_cache=not options.embed)
        self.lines = lines
        self.timeout_s = self.state.settings.request_timeout_s
        self.reader = MultipartReader(request.scope, boundary,
                                      int(self.state.settings.max_body_bytes), self._take)
        self.tasks: set[asyncio.Task[None]] = set()
        self.ok = self.failed = 0
        self.started = time.perf_counter()

    async def __call__(self, receive: Receive) -> None:
        stream_error: ApiError | None = None
        try:
            try:
                await self.reader.read(receive)
            except ClientGone:
                raise
            except ApiError as error:  # the body itself failed: stalled, too large, garbled
                stream_error = error
                self.reader.abandon(error)
            await self._settle(receive if stream_error is None else None)
        except ClientGone as gone:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            if not self.lines.head_sent:
                raise  # answered (to no one) and counted as /v1/classify does
            self.state.stats.count(gone.code)
            return
        if not self.lines.head_sent:
            raise stream_error or BadRequest("The multipart upload has no image: put each "
                                             "in a field named 'file'.")
        if stream_error is not None:
            self.state.stats.count(stream_error.code)
            await self.lines.write({"error": error_line(stream_error)})
        await self.lines.write({"summary": {
            "images": self.reader.parts, "ok": self.ok, "failed": self.failed,
            "seconds": round(time.perf_counter() - self.started, 3)}})
        await self.lines.end()

    async def _take(self, part: Part) -> bool:
        """An image part has begun: wait until there is room for it, then start its task,
        which takes its place in line before its bytes are kept (whether they are)."""
        while len(self.tasks) >= self._window():
            await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
        admitted: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(self._image(part, admitted))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return await admitted

    def _window(self) -> int:
        """Images in progress at most: the model's batch in force twice over."""
        engine = self.state.engine
        try:
            name = self.options.model or engine.settings.model
            return 2 * engine.view().queue.lanes[name]
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
        bytes are to be kept), then the path every image takes; its line last."""
        line: dict[str, Any] = {"index": part.index, "filename": part.filename}
        try:
            try:
                if part.index:
                    await self._take_token()
                model = await find_model(self.state, self.options.model,
                                         self.options.keep_alive_s, self.caller)
                place = await self._place(model.name)
            except BaseException:
                admitted.set_result(False)
                raise
            with place:
                started = time.perf_counter()
                admitted.set_result(True)
                line["result"] = self._result(await self._serve(part, model, place, started))
            self.ok += 1
        except ApiError as error:
            line["error"] = error_line(error)
        except Exception:
            log.exception("image %d of a stream failed", part.index)
            line["error"] = error_line(InternalError("Something went wrong inside vramguard. "
                                                     "The details are in its log."))
        if "error" in line:
            self.failed += 1
            self.state.stats.failed(line["error"]["code"], self.request.scope)
        await self.lines.write(line)

    async def _serve(self, part: Part, model: LoadedModel, place: Reservation,
                     started: float) -> Served:
        """The image's bytes, once read, through ``serve_in_place`` within
        ``request_timeout_s`` of their arrival (``after_body``); they are given back to
        the upload caps once decoded, or when it fails (its part's future keeps them until
        its line is written: a window's worth at most)."""
        held = len(await part.body)
        deadline = after_body(self.state)

        def decoded() -> None:
            nonlocal held
            body_dropped(self.request.scope, held)
            held = 0

        try:
            return await serve_in_place(self.request, model, place, part.body.result(),
                                        self.ask, deadline, started, watch=False,
                                        decoded=decoded)
        finally:
            body_dropped(self.request.scope, held)

    def _result(self, served: Served) -> dict[str, Any]:
        result = classification(served, self.options.top_k,
                                self.options.threshold).model_dump(mode="json")
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


async def _hang_up(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class ImageStream(Response):
    """The stream's answer: it reads the request's body itself while it writes the lines
    (Starlette's StreamingResponse would read and drop the body, watching for a hang-up)."""

    media_type = NDJSON

    def __init__(self, request: Request, options: Options, boundary: bytes,
                 sse: bool, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        super().__init__(media_type=SSE if sse else NDJSON)
        self.request, self.options, self.boundary, self.sse = request, options, boundary, sse
        self.extra = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await StreamRun(self.request, self.options, self.boundary,
                        LineWriter(send, self.sse, self.extra))(receive)


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
    threshold: Threshold = None,
) -> ImageStream:
    boundary = boundary_of(request)
    state = state_of(request)
    loaded, note = await find_model_asked(state, model, keep_alive, caller_of(request))
    check_task(loaded, CLASSIFY)
    if embed and not loaded.feature_dim:
        raise BadRequest(f"The model {loaded.name} cannot give image features; use an "
                         "EfficientNet-Lite model or leave out embed.")
    sse = SSE in request.headers.get("accept", "")
    # The stream writes its own head: what the keep-alive came to goes in with it.
    said = () if note is None else ((HEADER.lower().encode(), note_text(
        note, state.settings.max_keep_alive_s).encode()),)
    return ImageStream(request, Options(model, keep_alive, top_k, embed, threshold),
                       boundary, sse, said)
