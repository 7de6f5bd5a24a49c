"""Who may use the share of connections kept past everyone's part of the cap
(``app/http/connections.py``): the health checks, and callers that send the admin token,
a dashboard session or the API key.

Such a caller is known only from its request head, never from its connection, so the
share is decided per request: the connection past everyone's part is let in for its head
only, and ``OneAnswer`` serves a request from a trusted caller (then closes, so that the
share is held for one answer at a time) and gives anyone else the usual 503.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import Overloaded, Unauthorized
from app.gates.admin_token import check_bearer
from app.http.scope import authorization
from app.http.server import admin_caller
from app.http.state import AppState
from app.http.stats import RequestStats

HEALTH_CHECKS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})
CLOSE = (b"connection", b"close")
Trusted = Callable[[Scope], bool]


def health_check(scope: Scope) -> bool:
    """A request for a health check: it needs no token, and answers at once."""
    return scope["path"] in HEALTH_CHECKS


def trusted_caller(state: AppState) -> Trusted:
    """A health check, or a request that carries the admin token, a dashboard session or
    (on a server with one) the API key: what the server's own gates would let through."""
    is_admin = admin_caller(state)

    def trusted(scope: Scope) -> bool:
        if health_check(scope):
            return True
        header = authorization(scope)
        if not header:
            return False
        if state.api_key is not None:
            try:
                check_bearer(header, state.api_key)
                return True
            except Unauthorized:
                pass
        return is_admin(header)

    return trusted


@dataclass(frozen=True)
class OneAnswer:
    """What a connection past everyone's part of the cap gets: a trusted request is served
    and its connection closed after the answer; any other gets ``refusal`` (503, counted
    in ``stats``) and its connection is closed."""

    trusted: Trusted
    refusal: Callable[[], Overloaded]
    stats: RequestStats

    def around(self, app: ASGIApp) -> ASGIApp:
        async def served_or_closed(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and self.trusted(scope):
                scope["headers"] = [*scope["headers"], CLOSE]  # uvicorn closes after it
                await app(scope, receive, send)
                return
            self.stats.count(Overloaded.code)
            response = self.refusal().response()
            response.headers["connection"] = "close"
            await response(scope, receive, send)

        return served_or_closed
