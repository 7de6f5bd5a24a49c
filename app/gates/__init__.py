"""The HTTP gates in front of the model: Host and Origin checks, per-client rate limits,
body-size limits, and the admin token and dashboard sessions that admin calls need."""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

from app.errors import ApiError
from app.stats import RequestStats


async def refuse(error: ApiError, stats: RequestStats, scope: Scope, receive: Receive,
                 send: Send) -> None:
    """Answer ``error`` from a gate. Gates answer before any route runs, so the app's
    error handlers (which count every route's errors) never see these: count them here,
    so that /v1/stats shows every refusal."""
    stats.count(error.code)
    await error.response()(scope, receive, send)
