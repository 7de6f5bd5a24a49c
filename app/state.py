"""Everything one running app holds, in one object on ``app.state.vg``."""

from __future__ import annotations

from dataclasses import dataclass

from app.cache import ResultCache
from app.config import Settings
from app.engine.engine import InferenceEngine
from app.events import EventHub
from app.guard.rate_limit import RateLimiter
from app.guard.ui_session import UiSessions
from app.stats import RequestStats
from app.workers import CpuPool


@dataclass
class AppState:
    settings: Settings
    engine: InferenceEngine
    pool: CpuPool
    cache: ResultCache | None
    stats: RequestStats
    admin_token: str
    limiter: RateLimiter
    events: EventHub
    ui_sessions: UiSessions
