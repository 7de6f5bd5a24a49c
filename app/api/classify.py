"""``POST /v1/classify``: take a place in line (or 503 before the upload is read), read
the upload, decode it in a decode worker process through the CPU pool (or answer from the
result cache), queue it for the device thread in its place, and answer in JSON."""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress
from typing import Annotated, Any

import torch
from fastapi import APIRouter, Query, Request
from starlette.datastructures import UploadFile

from app.cache import cache_key
from app.engine.predictor import Ranked, Sample, numerics
from app.errors import BadRequest, ClientGone, NotFound, UnsupportedMediaType, too_busy_to_start
from app.gates.body_limit import body_done
from app.models import LoadedModel
from app.schemas import ClassifyResponse, ErrorResponse, PredictionOut
from app.state import AppState, state_of

router = APIRouter()
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 404, 408, 413, 415, 422, 503)
}
_NOT_IMAGES = {"image/svg+xml": "SVG drawings", "image/x-icon": "icons"}
_BODY_DOC = {
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


def _prepare(state: AppState, model: LoadedModel, data: bytes, deadline: float
             ) -> tuple[str | None, Ranked | torch.Tensor]:
    """On the CPU pool: the cache key and the cached ranking (by content hash), or the
    pixels, decoded and preprocessed by a decode worker process before ``deadline``."""
    key = None
    if state.cache is not None:
        key = cache_key(data, model.name, model.weights_version, numerics(model.device))
        hit = state.cache.get(key)
        if hit is not None and len(hit.indices) == len(model.labels):  # else not this model's
            return key, hit
    return key, torch.from_numpy(state.decoder.decode(data, model.preprocessing, deadline))


@router.post("/v1/classify", response_model=ClassifyResponse, responses=_ERRORS,
             openapi_extra=_BODY_DOC, summary="Classify one image")
async def classify(
    request: Request,
    top_k: Annotated[int, Query(ge=1, le=1000, description="How many classes to return.")] = 5,
    model: Annotated[str | None, Query(description="Model name; the loaded one if omitted.")]
    = None,
) -> ClassifyResponse:
    state = state_of(request)
    engine = state.engine
    if model is not None and model != state.settings.model:
        raise NotFound(f"Model '{model}' is not loaded; this appliance serves "
                       f"'{state.settings.model}'.")
    loaded = engine.require_runtime().model
    engine.require_unpaused()
    started = time.perf_counter()
    deadline = time.monotonic() + state.settings.request_timeout_s
    with engine.admit(state.settings.request_timeout_s) as place:
        data = await read_upload(request)
        key, found = await state.pool.run_before(deadline, _prepare, state, loaded, data,
                                                 deadline)
        del data
        body_done(request.scope)
        prepared = time.perf_counter()
        batch_size = 0
        if isinstance(found, Ranked):
            ranked = found
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                raise too_busy_to_start()
            work = asyncio.ensure_future(engine.classify(Sample(found, top_k), left, place))
            prediction = await unless_disconnected(request, work)
            ranked, batch_size = prediction.ranked, prediction.batch_size
    if key is not None and state.cache is not None and batch_size:
        await state.pool.run(state.cache.put, key, ranked)
    finished = time.perf_counter()
    top = ranked.top(top_k)
    labels = loaded.labels
    state.stats.count("ok" if batch_size else "cached")
    return ClassifyResponse(
        model=loaded.name,
        predictions=[PredictionOut(label=labels[int(i)], index=int(i), score=float(s))
                     for i, s in zip(top.indices, top.scores, strict=True)],
        batch_size=batch_size,
        cached=batch_size == 0,
        timing_ms={
            "read_and_decode": round((prepared - started) * 1000, 2),
            "queue_and_inference": round((finished - prepared) * 1000, 2),
            "total": round((finished - started) * 1000, 2),
        },
    )
