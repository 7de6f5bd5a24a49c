"""The outermost request layer: count and time every HTTP request by route family and
status, so that refusals made before any route runs (403, 429, 413, 503 for uploads) are
counted too. ``/metrics`` itself is not counted (a scrape would count itself)."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.http.scope import route_family
from app.observe.registry import Metrics


class MetricsMiddleware:
    """Outermost ASGI layer: counts and times every HTTP request by route family and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/metrics":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            route = route_family(scope["method"], scope["path"])
            labels = (route, str(status))
            self.metrics.requests.labels(*labels).inc()
            self.metrics.latency.labels(*labels).observe(time.perf_counter() - started)
