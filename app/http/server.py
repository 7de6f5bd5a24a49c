"""``create_app(settings)``: the app's state, its gates in request order, its routes, and
the lifespan (model start in the background, the memory monitor)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from app import __version__
from app.api import ROUTERS
from app.api.errors import install_error_handlers
from app.config import Settings
from app.engine.engine import InferenceEngine
from app.errors import Unauthorized
from app.gates.admin_token import check_bearer
from app.gates.api_key import ApiKeyGate, load_api_key
from app.gates.body_limit import BodySizeLimit
from app.gates.host_origin import HostOriginGate
from app.gates.rate_limit import Limiter, Rate, RateLimiter, RateLimitMiddleware
from app.gates.request_metrics import MetricsMiddleware
from app.gates.ui_session import UiSessions
from app.gates.upload_deadline import UploadPace
from app.host.exit_status import GPU_LOST
from app.host.token_file import AdminToken, load_or_create_token
from app.http import openapi_doc
from app.http.live_feed import LiveFeed
from app.http.state import AppState
from app.http.stats import RequestStats
from app.imaging.cpu_pool import CpuPool
from app.imaging.decode_pool import DecodeLimits, DecodePool
from app.imaging.result_cache import ResultCache
from app.observe.collector import AppCollector
from app.observe.registry import Metrics
from app.schemas import LiveSample

log = logging.getLogger("vramguard.server")
MONITOR_INTERVAL_S = 1.0


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Serve /healthz at once; load and warm the model in the background (/readyz waits)."""
    state: AppState = app.state.vg
    starting = asyncio.create_task(state.engine.start())
    monitor = asyncio.create_task(_monitor(state))
    state.decoder.start()
    try:
        yield
    finally:
        starting.cancel()
        monitor.cancel()
        await asyncio.to_thread(state.engine.stop)
        state.pool.shutdown()
        state.decoder.close()
        if state.cache is not None:
            state.cache.close()


async def _monitor(state: AppState) -> None:
    """Once a second: on the device thread follow memory, update the state, release when
    idle; then publish a live sample (and a state event when the state changed)."""
    engine = state.engine
    last_state = None
    while True:
        await asyncio.sleep(MONITOR_INTERVAL_S)
        if engine.health.device_lost:
            # Its CUDA context is broken for good: only a new process can use the card.
            log.error("the graphics card stopped working (%s); vramguard exits with status "
                      "%d so that it is started again", engine.health.error, GPU_LOST)
            state.on_gpu_lost()
            return
        if not engine.ready:
            state.feed.heartbeat(engine.phase.value)
            continue
        try:
            await engine.on_device(engine.tick)
        except Exception:
            log.exception("memory monitor failed")
            continue
        sample = live_sample(state)
        if sample is None:
            continue
        if sample.state != last_state:
            state.feed.publish("state", {"state": sample.state.value, "t": sample.t})
            last_state = sample.state
        state.feed.publish("sample", sample.model_dump(mode="json"))


def live_sample(state: AppState) -> LiveSample | None:
    """What the tray and the dashboard draw: memory, queue and outcomes, right now."""
    view = state.engine.view()
    if view.memory is None:
        return None
    queue = view.queue
    return LiveSample(
        **view.memory.model_dump(),
        t=round(time.time(), 3),
        queue_depth=queue.queue_depth,
        in_flight=queue.in_flight,
        batches=queue.batches,
        mean_batch_size=round(queue.mean_batch_size, 3),
        paused=view.paused,
        requests=state.stats.snapshot(),
        rate_limited=state.limiter.rejected,
        serving=state.stats.serving.report(state.settings.model),
    )


def limit_rates(settings: Settings) -> tuple[dict[str, Rate], dict[str, Rate]]:
    """Per-client and global rates by route family: one table for the in-process limiter
    and the cluster's shared one (app/cluster/redis_limiter.py)."""
    return ({"classify": Rate(settings.classify_burst, settings.classify_per_s),
             "read": Rate(settings.read_burst, settings.read_per_s),
             "admin": Rate(settings.admin_burst, settings.admin_per_s)},
            {"classify": Rate(settings.global_burst, settings.global_per_s),
             "read": Rate(settings.global_read_burst, settings.global_read_per_s),
             "admin": Rate(settings.global_admin_burst, settings.global_admin_per_s)})


def make_limiter(settings: Settings) -> RateLimiter:
    return RateLimiter(*limit_rates(settings))


def admin_caller(state: AppState) -> Callable[[str], bool]:
    """Whether an Authorization header holds the admin token or a dashboard session: the
    rate limiter gives such callers buckets of their own, before any route runs."""

    def is_admin(header: str) -> bool:
        scheme, _, given = header.partition(" ")
        if scheme.lower() == "bearer" and state.ui_sessions.valid(given.strip()):
            return True
        try:
            check_bearer(header, state.admin_token.current())
        except Unauthorized:
            return False
        return True

    return is_admin


def make_decoder(settings: Settings, workers: int) -> DecodePool:
    """One decode process per CPU-pool thread, with the settings' limits."""
    limits = DecodeLimits(max_pixels=settings.max_image_pixels,
                          max_image_bytes=int(settings.max_image_memory),
                          cpu_s=settings.decode_cpu_limit_s,
                          max_body_bytes=int(settings.max_body_bytes))
    return DecodePool(workers, limits, int(settings.decode_memory_budget))


def make_state(settings: Settings, engine: InferenceEngine | None = None,
               limiter: Limiter | None = None) -> AppState:
    """Everything the app holds; ``engine`` lets in-process tests bring their own, and
    ``limiter`` a cluster replica its shared buckets (app/cluster); ApiKeyFileError when
    the API key file cannot be used (read first, before anything is started). Its
    metrics registry reads the state through the collector registered here."""
    api_key = load_api_key(settings.api_key_file) if settings.api_key_file else None
    cache = ResultCache(settings.cache_dir, int(settings.cache_size)) if settings.cache else None
    pool = CpuPool(settings.decode_workers, max_waiting=settings.queue_size)
    state = AppState(
        settings=settings,
        engine=engine or InferenceEngine(settings),
        pool=pool,
        decoder=make_decoder(settings, pool.workers),
        cache=cache,
        stats=RequestStats(),
        admin_token=AdminToken(settings.token_file, load_or_create_token(settings.token_file)),
        limiter=limiter or make_limiter(settings),
        feed=LiveFeed(),
        ui_sessions=UiSessions(),
        metrics=Metrics(),
        api_key=api_key,
    )
    state.metrics.register(AppCollector(state))
    return state


def gates(settings: Settings, state: AppState) -> list[Middleware]:
    """The ASGI layers every request passes, in the order it passes them."""
    is_admin = admin_caller(state)
    layers = [
        Middleware(MetricsMiddleware, metrics=state.metrics),
        Middleware(HostOriginGate, port=settings.port, extra_hosts=settings.allowed_hosts,
                   allowed_origins=settings.cors_origins, stats=state.stats),
    ]
    # CORS before the rate limiter: a 429 must reach a page with its CORS header and its
    # Retry-After readable, or the page sees a network error and retries blindly.
    if settings.cors_origins:
        layers.append(Middleware(CORSMiddleware, allow_origins=settings.cors_origins,
                                 allow_methods=["GET", "POST"],
                                 allow_headers=["Authorization", "Content-Type",
                                                "X-Client-Id"],
                                 expose_headers=["Retry-After", "RateLimit-Limit",
                                                 "RateLimit-Remaining", "RateLimit-Reset",
                                                 "X-Vramguard-Keep-Alive"]))
    # The API key after CORS (a preflight carries no key, and a page must be able to read
    # a 401) and before the rate limiter: a request without the key is charged nothing,
    # so strangers cannot spend the tokens of clients that have it.
    if state.api_key is not None:
        layers.append(Middleware(ApiKeyGate, key=state.api_key, is_admin=is_admin,
                                 stats=state.stats))
    if settings.rate_limit:
        layers.append(Middleware(RateLimitMiddleware, limiter=state.limiter,
                                 stats=state.stats, is_admin=is_admin))
    layers.append(Middleware(
        BodySizeLimit, max_bytes=int(settings.max_body_bytes),
        max_inflight_bytes=int(settings.max_inflight_body_bytes),
        max_client_bytes=int(settings.max_inflight_body_bytes_per_client),
        read_timeout_s=settings.body_read_timeout_s, stats=state.stats,
        max_stream_bytes=int(settings.max_stream_bytes),
        pace=UploadPace(int(settings.min_upload_bytes_per_s), settings.upload_grace_s)))
    return layers


def create_app(settings: Settings, engine: InferenceEngine | None = None,
               limiter: Limiter | None = None) -> FastAPI:
    """Build the app; the model loads when the app starts (lifespan), not here."""
    return app_over(make_state(settings, engine, limiter))


def app_over(state: AppState, *, port: int | None = None, runs_lifespan: bool = True
             ) -> FastAPI:
    """The app over ``state``. A cluster replica (app/cluster/replica.py) builds a second
    one over the same state for its own port: its Host check names ``port``, and it has no
    lifespan, since the first app's starts and stops the engine they share."""
    settings = state.settings
    if port is not None:
        settings = settings.model_copy(update={"port": port})
    app = FastAPIOffline(
        title="vramguard",
        version=__version__,
        description="Local image classification that guards GPU memory.",
        lifespan=lifespan if runs_lifespan else None,
        redoc_url=None,
        middleware=gates(settings, state),
    )
    app.state.vg = state
    for router in ROUTERS:
        app.include_router(router)
    install_error_handlers(app)
    openapi_doc.install(app)
    return app
