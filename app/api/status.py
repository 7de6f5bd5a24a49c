"""What monitoring reads: ``/v1/stats``, ``/metrics``, ``/healthz`` and ``/readyz``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from app.errors import NotReady
from app.http.state import state_of
from app.schemas import ErrorResponse, StatsResponse

router = APIRouter()


@router.get("/v1/stats", response_model=StatsResponse, summary="Queue and request counters")
async def stats(request: Request) -> StatsResponse:
    state = state_of(request)
    view = state.engine.view()
    queue = view.queue
    return StatsResponse(
        uptime_s=round(state.stats.uptime_s, 3),
        phase=view.phase.value,
        paused=view.paused,
        queue_depth=queue.queue_depth,
        in_flight=queue.in_flight,
        batches=queue.batches,
        batched_images=queue.batched_images,
        mean_batch_size=round(queue.mean_batch_size, 3),
        largest_batch=queue.largest_batch,
        expired_in_queue=queue.expired,
        withdrawn_in_queue=queue.withdrawn,
        requests=state.stats.snapshot(),
        rate_limited=state.limiter.rejected,
        cache_entries=await state.pool.run(len, state.cache) if state.cache is not None else None,
    )


@router.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    return Response(state_of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/healthz", summary="The process is up")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Warmup has finished", responses={503: {"model": ErrorResponse}})
async def readyz(request: Request) -> JSONResponse:
    """Answered directly (not raised): polling readiness is not a request outcome to count."""
    view = state_of(request).engine.view()
    if not view.ready:
        return NotReady(view.not_ready_message, retry_after=2).response()
    return JSONResponse({"status": "ready"})
