"""``create_app(settings)``: wiring, lifespan and the mapping of errors to JSON."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from app import __version__
from app.admin_routes import router as admin_router
from app.cache import ResultCache
from app.config import Settings
from app.engine.engine import InferenceEngine
from app.errors import ApiError, BadRequest, InternalError, MethodNotAllowed, NotFound
from app.events import EventHub
from app.guard.admin_token import load_or_create_token
from app.guard.body_limit import BodySizeLimit
from app.guard.host_origin import HostOriginGuard
from app.guard.rate_limit import Rate, RateLimiter, RateLimitMiddleware
from app.guard.ui_session import UiSessions
from app.memory_routes import router as memory_router
from app.metrics import Metrics, MetricsMiddleware
from app.routes import router
from app.state import AppState
from app.stats import RequestStats
from app.ui_routes import router as ui_router
from app.workers import CpuPool

log = logging.getLogger("vramguard.server")
MONITOR_INTERVAL_S = 1.0


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Serve /healthz at once; load and warm the model in the background (/readyz waits)."""
    state: AppState = app.state.vg
    starting = asyncio.create_task(state.engine.start())
    monitor = asyncio.create_task(_monitor(state))
    try:
        yield
    finally:
        starting.cancel()
        monitor.cancel()
        await asyncio.to_thread(state.engine.stop)
        state.pool.shutdown()
        if state.cache is not None:
            state.cache.close()


async def _monitor(state: AppState) -> None:
    """Once a second: on the device thread follow memory, update the state, release when
    idle; then publish a live sample (and a state event when the state changed)."""
    engine = state.engine
    last_state = None
    while True:
        await asyncio.sleep(MONITOR_INTERVAL_S)
        if not engine.ready:
            continue
        try:
            await engine.on_device(engine.tick)
        except Exception:
            log.exception("memory monitor failed")
            continue
        sample = live_sample(state)
        if sample.get("state") != last_state:
            state.events.publish("state", {"state": sample.get("state"), "t": sample["t"]})
            last_state = sample.get("state")
        state.events.publish("sample", sample)


def live_sample(state: AppState) -> dict[str, object]:
    """What the tray and the dashboard draw: memory, queue and outcomes, right now."""
    batcher = state.engine.batcher
    return {
        **state.engine.last_report,
        "t": round(time.time(), 3),
        "queue_depth": batcher.queue_depth,
        "in_flight": batcher.in_flight,
        "batches": batcher.stats.batches,
        "mean_batch_size": round(batcher.stats.mean_batch_size, 3),
        "paused": state.engine.paused,
        "requests": state.stats.snapshot(),
        "rate_limited": state.limiter.rejected,
    }


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error.get("loc", ()) if p not in ("query", "body"))
        parts.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    return "Invalid request: " + "; ".join(parts)


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    request.app.state.vg.stats.count(exc.code)
    return exc.response()


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return await _on_api_error(request, BadRequest(_validation_message(exc)))


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    mapped: ApiError
    if exc.status_code == 404:
        mapped = NotFound(f"There is no {request.url.path} here. See /docs for the API.")
    elif exc.status_code == 405:
        mapped = MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}.")
    else:
        mapped = ApiError(str(exc.detail))
        mapped.status, mapped.code = exc.status_code, "bad_request"
    return await _on_api_error(request, mapped)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return await _on_api_error(request, InternalError(
        "Something went wrong inside vramguard. The details are in its log."))


def make_limiter(settings: Settings) -> RateLimiter:
    return RateLimiter(
        per_client={"classify": Rate(settings.classify_burst, settings.classify_per_s),
                    "read": Rate(settings.read_burst, settings.read_per_s),
                    "admin": Rate(settings.admin_burst, settings.admin_per_s)},
        global_rates={"classify": Rate(settings.global_burst, settings.global_per_s)})


def create_app(settings: Settings) -> FastAPI:
    """Build the app; the model loads when the app starts (lifespan), not here."""
    app = FastAPIOffline(
        title="vramguard",
        version=__version__,
        description="Local image classification that guards GPU memory.",
        lifespan=lifespan,
        redoc_url=None,
    )
    cache = ResultCache(settings.cache_dir, int(settings.cache_size)) if settings.cache else None
    app.state.vg = AppState(
        settings=settings,
        engine=InferenceEngine(settings),
        pool=CpuPool(settings.decode_workers, max_waiting=settings.queue_size),
        cache=cache,
        stats=RequestStats(),
        admin_token=load_or_create_token(settings.token_file),
        limiter=make_limiter(settings),
        events=EventHub(),
        ui_sessions=UiSessions(),
    )
    app.include_router(router)
    app.include_router(memory_router)
    app.include_router(admin_router)
    app.include_router(ui_router)
    # Added innermost first. Outermost to innermost: metrics, Host/Origin check, rate limit,
    # CORS, body size.
    app.add_middleware(BodySizeLimit, max_bytes=int(settings.max_body_bytes),
                       max_inflight_bytes=int(settings.max_inflight_body_bytes))
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins,
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Client-Id"])
    if settings.rate_limit:
        app.add_middleware(RateLimitMiddleware, limiter=app.state.vg.limiter)
    app.add_middleware(HostOriginGuard, port=settings.port, extra_hosts=settings.allowed_hosts,
                       allowed_origins=settings.cors_origins)
    app.state.metrics = Metrics(app.state.vg)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
    return app
