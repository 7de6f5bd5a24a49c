"""The v1 HTTP endpoints. Handlers only await: CPU work goes to the pool, model work
to the device thread."""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress
from typing import Annotated, Any

import torch
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import UploadFile

from app.cache import cache_key
from app.engine.predictor import Ranked, Sample
from app.errors import (
    ApiError,
    BadRequest,
    DeadlineExceeded,
    NotFound,
    NotReady,
    Overloaded,
    UnsupportedMediaType,
)
from app.imaging import decode_image, preprocess
from app.schemas import (
    ClassifyResponse,
    ErrorResponse,
    ModelOut,
    ModelsResponse,
    PredictionOut,
    StatsResponse,
)
from app.state import AppState

router = APIRouter()
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 404, 413, 415, 503)
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


class ClientGone(ApiError):
    """The client disconnected while its request waited; nobody reads this answer."""

    status, code = 499, "client_closed"


def state_of(request: Request) -> AppState:
    return request.app.state.vg  # type: ignore[no-any-return]


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


def _prepare(state: AppState, data: bytes) -> tuple[str | None, Ranked | None, torch.Tensor | None]:
    """On the CPU pool: cache lookup by content hash, else decode and preprocess."""
    model = state.engine.model
    assert model is not None
    key = None
    if state.cache is not None:
        key = cache_key(data, model.name, model.weights_version)
        hit = state.cache.get(key)
        if hit is not None:
            return key, hit, None
    spec = model.preprocessing
    image = decode_image(data, state.settings.max_image_pixels, draft_size=spec.resize)
    return key, None, preprocess(image, spec)


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
    if not engine.ready or engine.model is None:
        raise NotReady(engine.not_ready_message(), retry_after=5)
    started = time.perf_counter()
    deadline = time.monotonic() + state.settings.request_timeout_s
    data = await read_upload(request)
    key, ranked, pixels = await state.pool.run_before(deadline, _prepare, state, data)
    prepared = time.perf_counter()
    batch_size = 0
    if ranked is None:
        assert pixels is not None
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("vramguard is too busy to look at this image in time. "
                                   "Try again shortly.", retry_after=2)
        work = asyncio.ensure_future(engine.classify(Sample(pixels, top_k), left))
        prediction = await unless_disconnected(request, work)
        ranked, batch_size = prediction.ranked, prediction.batch_size
        if key is not None and state.cache is not None:
            await state.pool.run(state.cache.put, key, ranked)
    finished = time.perf_counter()
    top = ranked.top(top_k)
    labels = engine.model.labels
    state.stats.count("ok" if batch_size else "cached")
    return ClassifyResponse(
        model=engine.model.name,
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


@router.get("/v1/models", response_model=ModelsResponse, summary="The loaded model")
async def models(request: Request) -> ModelsResponse:
    engine = state_of(request).engine
    if engine.model is None or engine.warmup is None:
        return ModelsResponse(models=[])
    loaded, warmup = engine.model, engine.warmup
    weights_bytes = sum(t.numel() * t.element_size()
                        for t in (*loaded.module.parameters(), *loaded.module.buffers()))
    return ModelsResponse(models=[ModelOut(
        name=loaded.name,
        device=str(loaded.device),
        weights_file=str(loaded.weights_file),
        weights_version=loaded.weights_version,
        weights_bytes=weights_bytes,
        input_size=loaded.preprocessing.crop,
        max_batch_size=engine.batcher.max_batch,
        warmup_seconds=round(warmup.duration_s, 3),
        warmup=[{"batch_size": t.batch_size, "latency_ms": round(t.seconds * 1000, 2),
                 "images_per_second": round(t.images_per_second, 2)} for t in warmup.timings],
    )])


@router.get("/v1/stats", response_model=StatsResponse, summary="Queue and request counters")
async def stats(request: Request) -> StatsResponse:
    state = state_of(request)
    batcher = state.engine.batcher
    return StatsResponse(
        uptime_s=round(state.stats.uptime_s, 3),
        phase=state.engine.phase.value,
        paused=state.engine.paused,
        queue_depth=batcher.queue_depth,
        in_flight=batcher.in_flight,
        batches=batcher.stats.batches,
        batched_images=batcher.stats.items,
        mean_batch_size=round(batcher.stats.mean_batch_size, 3),
        largest_batch=batcher.stats.largest_batch,
        expired_in_queue=batcher.stats.expired,
        withdrawn_in_queue=batcher.stats.cancelled,
        requests=state.stats.snapshot(),
        rate_limited=state.limiter.rejected,
        cache_entries=await state.pool.run(len, state.cache) if state.cache is not None else None,
    )


@router.get("/v1/events", summary="Live memory and queue samples (Server-Sent Events)",
            response_class=StreamingResponse)
async def events(request: Request) -> StreamingResponse:
    hub = state_of(request).events
    if hub.full():
        raise Overloaded("Too many live views are open. Close one and try again.",
                         retry_after=5)
    return StreamingResponse(hub.stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store"})


@router.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/healthz", summary="The process is up")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Warmup has finished", responses={503: {"model": ErrorResponse}})
async def readyz(request: Request) -> JSONResponse:
    """Answered directly (not raised): polling readiness is not a request outcome to count."""
    engine = state_of(request).engine
    if not engine.ready:
        return NotReady(engine.not_ready_message(), retry_after=2).response()
    return JSONResponse({"status": "ready"})
