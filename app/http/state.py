"""Everything one running app holds, in one object on ``app.state.vg``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.requests import HTTPConnection

from app.config import Settings
from app.engine.engine import InferenceEngine
from app.gates.rate_limit import Limiter
from app.gates.ui_session import UiSessions
from app.host.token_file import AdminToken
from app.http.live_feed import LiveFeed
from app.http.stats import RequestStats
from app.imaging.cpu_pool import CpuPool
from app.imaging.decode_pool import DecodePool
from app.imaging.result_cache import ResultCache
from app.observe.registry import Metrics


@dataclass
class AppState:
    settings: Settings
    engine: InferenceEngine
    pool: CpuPool
    decoder: DecodePool
    cache: ResultCache | None
    stats: RequestStats
    admin_token: AdminToken
    limiter: Limiter
    feed: LiveFeed
    ui_sessions: UiSessions
    metrics: Metrics
    api_key: str | None  # read once from api_key_file, for every face of the app
    # Ends the process when the graphics card stopped working (`serve` sets it; in a
    # test's app or a cluster replica nothing ends, and the engine answers 503).
    on_gpu_lost: Callable[[], None] = field(default=lambda: None)


def state_of(connection: HTTPConnection) -> AppState:
    """The app's state, typed, from a request handler or dependency."""
    state = connection.app.state.vg
    if not isinstance(state, AppState):
        raise TypeError("the app was not built by create_app")
    return state
