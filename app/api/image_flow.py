"""What every route that sends an image to a model does: find the model (loading it when
a request asks for one not loaded), take a place in line (or 503 before the upload is
read), read the upload, decode it in a decode worker process through the CPU pool (or
answer from the result cache), and queue it for the device thread in its place.

``serve_image`` is that whole path for one upload (``/v1/classify``, ``/v1/embed``). An
image in its place goes on through ``serve_in_place`` on every route, so a change to the
path is made once: ``/v2`` infer and the image stream take their places their own way (all
of a request's at once; one per part, waiting for room) and call it for each image."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import torch
from fastapi import Depends, Query, Request
from starlette.datastructures import UploadFile

from app.api.keep_alive import UNNAMED, Caller, caller_of, keep_alive_query, say
from app.engine.lanes import Reservation
from app.engine.predictor import CLASSIFY, EMBED, Ranked, Sample, numerics
from app.engine.residency import StayNote
from app.errors import (
    BadRequest,
    ClientGone,
    DeadlineExceeded,
    Loading,
    Overloaded,
    UnsupportedMediaType,
    too_busy_to_start,
)
from app.gates.body_limit import body_done
from app.http.state import AppState, state_of
from app.imaging.result_cache import cache_key
from app.models import LoadedModel

_NOT_IMAGES = {"image/svg+xml": "SVG drawings", "image/x-icon": "icons"}
BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "image/*": {"schema": {"type": "string", "format": "binary"}},
            "multipart/form-data": {
                "schema": {"type": "object", "required": ["file"],
                           "properties": {"file": {"type": "string", "format": "binary"}}}
            },
        },
    }
}
# The query parameters every image route takes, declared once.
TopK = Annotated[int, Query(ge=1, le=1000, description="How many classes to return.")]
ModelQuery = Annotated[str | None, Query(max_length=64, description="Model name (GET "
                                         "/v1/models); the --model one if omitted. A model "
                                         "not loaded yet is loaded first.")]
Threshold = Annotated[float | None, Query(
    gt=0, lt=1, description="A multilabel model only: the score a label needs to be in the "
    "answer; default: the model's own.")]
KeepAlive = Annotated[float | None, Depends(keep_alive_query)]  # see app/api/keep_alive.py
Cached = Ranked | np.ndarray
Prepared = tuple[str | None, Cached | torch.Tensor]  # the cache key; the answer or pixels
Image = bytes | torch.Tensor  # an upload's bytes, or pixels already preprocessed (a tensor)


@dataclass(frozen=True)
class Ask:
    """What each image of a request is asked for: the forward pass's task, how many classes
    come back, and whether the result cache may answer (it holds a ranking or features,
    never both, so an answer with both skips it)."""

    task: str
    top_k: int
    use_cache: bool = True


@dataclass(frozen=True)
class Served:
    """One image's answer: a ranking (and features, for an embedding), where it came from."""

    model: LoadedModel
    ranked: Ranked | None
    embedding: np.ndarray | None
    batch_size: int | None  # None: from the result cache (no batch computed it)
    read_and_decode_s: float
    total_s: float

    def timing_ms(self) -> dict[str, float]:
        return {"read_and_decode": round(self.read_and_decode_s * 1000, 2),
                "queue_and_inference": round((self.total_s - self.read_and_decode_s) * 1000,
                                             2),
                "total": round(self.total_s * 1000, 2)}


async def read_upload(request: Request) -> bytes:
    """The image bytes from a raw ``image/*`` body or a multipart field ``file``."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "multipart/form-data":
        form = await request.form(max_files=1, max_fields=16)
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise BadRequest("The multipart upload has no image: put it in a field named 'file'.")
        return await upload.read()
    if ctype in _NOT_IMAGES:
        raise UnsupportedMediaType(f"{_NOT_IMAGES[ctype].capitalize()} cannot be classified. "
                                   "Send a JPEG, PNG, WebP, BMP, GIF or TIFF image.")
    if ctype in ("", "application/octet-stream") or ctype.startswith("image/"):
        return await request.body()
    raise UnsupportedMediaType(
        f"Content-Type '{ctype}' is not accepted. Send the image bytes with a Content-Type "
        "such as image/jpeg or image/png, or upload it as a multipart form field 'file'.")


async def until_disconnected(request: Request) -> None:
    """Return when the client hangs up (the body has been read, so only that can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: asyncio.Future[Any]) -> Any:
    """Await ``work``; if the client leaves first, cancel it (a queued request is withdrawn)."""
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with suppress(asyncio.CancelledError):
        await work
    raise ClientGone("The client disconnected before its answer was ready.")


def _prepare(state: AppState, model: LoadedModel, data: bytes, deadline: float,
             task: str = CLASSIFY, use_cache: bool = True) -> Prepared:
    """On the CPU pool: the cache key and the cached answer (by content hash), or the
    pixels, decoded and preprocessed by a decode worker process before ``deadline``."""
    key = None
    if use_cache and state.cache is not None:
        key = cache_key(data, model.name, model.weights_version,
                        numerics(model.device, model.numerics), task)
        hit: Cached | None
        if task == CLASSIFY:
            hit = state.cache.get(key)
            if hit is not None and len(hit.indices) != len(model.labels):
                hit = None  # another model's ranking
        else:
            hit = state.cache.get_embedding(key)
            if hit is not None and len(hit) != model.feature_dim:
                hit = None
        if hit is not None:
            return key, hit
    return key, torch.from_numpy(state.decoder.decode(data, model.preprocessing, deadline))


async def prepare(state: AppState, model: LoadedModel, data: bytes, deadline: float,
                  task: str = CLASSIFY, *, use_cache: bool = True) -> Prepared:
    """An image's bytes, already read, to its cached answer or its pixels (``_prepare``),
    on the CPU pool; refused at once when the pool could not start it before ``deadline``.
    ``use_cache=False`` for an answer the cache holds only half of (ranking and features)."""
    return await state.pool.run_before(deadline, _prepare, state, model, data, deadline, task,
                                       use_cache)


async def answer(request: Request, model: LoadedModel, prepared: Prepared, place: Reservation,
                 deadline: float, task: str, top_k: int, started: float, *,
                 watch: bool = True) -> Served:
    """A prepared image's answer: the cached one, or computed in its place in line (then
    cached). ``watch``: withdraw it if the client hangs up; a route that sends several
    images of one request watches them all at once instead (one reader of the connection)."""
    state = state_of(request)
    engine = state.engine
    key, found = prepared
    prepared_at = time.perf_counter()
    batch_size: int | None = None
    ranked, embedding = None, None
    if isinstance(found, Ranked):
        ranked = found
    elif isinstance(found, np.ndarray):
        embedding = found
    else:
        left = deadline - time.monotonic()
        if left <= 0:
            raise too_busy_to_start()
        work = asyncio.ensure_future(engine.classify(Sample(found, top_k, task), left, place,
                                                     model.name))
        prediction = await (unless_disconnected(request, work) if watch else work)
        batch_size, ranked = prediction.batch_size, prediction.ranked
        embedding = prediction.embedding
    if key is not None and state.cache is not None and batch_size is not None:
        if embedding is not None:
            await state.pool.run(state.cache.put_embedding, key, embedding)
        elif ranked is not None:
            await state.pool.run(state.cache.put, key, ranked)
    outcome = "cached" if batch_size is None else "ok"
    total_s = time.perf_counter() - started
    state.stats.answered(model.name, outcome, total_s)
    engine.count(model.name, outcome)
    return Served(model, ranked, embedding, batch_size, prepared_at - started, total_s)


async def find_model(state: AppState, name: str | None, keep_alive_s: float | None = None,
                     caller: Caller = UNNAMED) -> LoadedModel:
    """The model ``name`` (default: --model), unless an admin has paused the appliance:
    loaded, or loaded now (charged to ``caller``), waiting up to ``request_timeout_s``
    (then 503 ``loading``); ``keep_alive_s`` as ``app.api.keep_alive`` says."""
    return (await find_model_asked(state, name, keep_alive_s, caller))[0]


async def find_model_asked(state: AppState, name: str | None, keep_alive_s: float | None,
                           caller: Caller) -> tuple[LoadedModel, StayNote | None]:
    """``find_model``, and what of ``keep_alive_s`` was not done as asked (for the answer's
    header): the admin's is set as it is, anyone else's may only lengthen the stay."""
    state.engine.require_unpaused()
    runtime = await state.engine.acquire(name, state.settings.request_timeout_s,
                                         keep_alive_s if caller.admin else None, caller.client)
    resident = state.engine.residents.get(runtime.model.name)
    if caller.admin or keep_alive_s is None or resident is None:
        return runtime.model, None
    return runtime.model, resident.lengthen(keep_alive_s, state.settings.max_keep_alive_s)


def check_task(model: LoadedModel, task: str) -> None:
    """BadRequest when ``model`` cannot answer ``task``: an embedding model does not
    classify, and a model without a final linear layer gives no features."""
    if task == CLASSIFY and model.task == EMBED:
        raise BadRequest(f"The model {model.name} gives image features only; send the image "
                         "to /v1/embed.")
    if task == EMBED and not model.feature_dim:
        raise BadRequest(f"The model {model.name} cannot give image features (it has no "
                         "final linear layer to take them from); use an EfficientNet-Lite "
                         "model.")


def just_loaded(name: str) -> Loading:
    return Loading(f"The model {name} has just been loaded, which took this request's "
                   "time; try again now.", retry_after=1)


def admit_after(state: AppState, model: LoadedModel, deadline: float,
                waited_for_load: bool) -> Reservation:
    """The first place in line of a request; one that spent its time waiting for the model
    to load and has too little left is told ``loading`` (come back now), not
    ``overloaded``: the line is not why."""
    try:
        return state.engine.admit(max(0.0, deadline - time.monotonic()), model.name)
    except Overloaded:
        if not waited_for_load:
            raise
        raise just_loaded(model.name) from None


@contextmanager
def in_time_left_by_load(name: str, waited_for_load: bool) -> Iterator[None]:
    """A request whose deadline passes after it waited for ``name`` to load is told
    ``loading`` (come back now) rather than ``deadline_exceeded``: the load took its time
    (the model's first batch can also wait behind a measuring pass of it)."""
    try:
        yield
    except DeadlineExceeded:
        if not waited_for_load:
            raise
        raise just_loaded(name) from None


def is_loaded(state: AppState, name: str | None) -> bool:
    """Whether ``name`` (default: --model) is loaded now (else a request waits for it)."""
    return (name or state.settings.model) in state.engine.runtimes


async def serve_in_place(request: Request, model: LoadedModel, place: Reservation,
                         image: Image, ask: Ask, deadline: float, started: float, *,
                         watch: bool = True,
                         decoded: Callable[[], None] = lambda: None) -> Served:
    """One image in its place in line, to its answer: bytes to their cached answer or
    pixels (``prepare``; a tensor is pixels already), then ``decoded`` (the caller gives
    the bytes back to the upload caps: nothing holds them here any more), then the answer
    (``answer``; ``watch`` as there). The caller passes ``image`` without keeping it, so
    that its bytes are freed before the image waits for the device."""
    if isinstance(image, torch.Tensor):
        prepared: Prepared = (None, image)
    else:
        prepared = await prepare(state_of(request), model, image, deadline, ask.task,
                                 use_cache=ask.use_cache)
        del image
        decoded()
    return await answer(request, model, prepared, place, deadline, ask.task, ask.top_k,
                        started, watch=watch)


def after_body(state: AppState) -> float:
    """The deadline of a request whose whole body has arrived: ``request_timeout_s`` from
    now. Reading the body is bounded by the upload's own deadline (``upload_grace_s`` plus
    its bytes at ``min_upload_bytes_per_s``), so a large image on a slow link is not
    refused for the time its upload took; waiting for a place before it is bounded by the
    deadline from the request's start."""
    return time.monotonic() + state.settings.request_timeout_s


async def serve_image(request: Request, model: str | None, keep_alive_s: float | None,
                      task: str, top_k: int) -> Served:
    """One upload through the whole path, for ``task`` on ``model`` (default: --model)."""
    state = state_of(request)
    started = time.perf_counter()
    deadline = time.monotonic() + state.settings.request_timeout_s
    waits = not is_loaded(state, model)
    loaded, note = await find_model_asked(state, model, keep_alive_s, caller_of(request))
    say(request, note)
    check_task(loaded, task)
    with admit_after(state, loaded, deadline, waits) as place, \
            in_time_left_by_load(loaded.name, waits):
        # Arguments are evaluated in order: the body is read before ``after_body`` starts
        # the clock for the rest (the upload has its own deadline).
        return await serve_in_place(request, loaded, place, await read_upload(request),
                                    Ask(task, top_k), after_body(state), started,
                                    decoded=lambda: body_done(request.scope))
