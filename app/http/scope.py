"""What a request is, read from its ASGI scope alone: its route family, whether a route
exists for it, which client sent it and the authorization it carries.

The gates and the metrics share these, so the rate limiter, the upload caps and the
request counts agree on what a "client" and a "family" are. Nothing here reads the body
or the app's state.
"""

from __future__ import annotations

import re

from starlette.routing import Match
from starlette.types import Scope

_CLIENT_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
ADMIN_CALLER = "#admin"  # appended to an authenticated caller's key (ids cannot hold '#')
HANDSHAKES = frozenset({"/v1/identity", "/v1/ui/session"})
NOT_GLOBAL = frozenset({"/healthz", "/readyz", "/v1/events", "/v2/health/live",
                        "/v2/health/ready"})
# Routes that send images to a model: they share the classify buckets. So does the Open
# Inference Protocol's infer route, for any model and version (app/api/oip.py). The rate limiter
# charges them (app/gates/rate_limit.py); the metrics label requests by them.
STREAM_ROUTES = frozenset({"/v1/classify/stream"})  # many images, a token each (above)
IMAGE_ROUTES = frozenset({"/v1/classify", "/v1/embed"}) | STREAM_ROUTES
TOKEN_KEY = "vramguard.take_token"  # in a stream's scope: () -> awaitable Decision, a token
OIP_INFER = re.compile(r"^/v2/models/[^/]+(?:/versions/[^/]+)?/infer$")


def route_family(method: str, path: str) -> str:
    """classify, admin (state-changing /v1 calls) or read (everything else), by the
    request's shape alone (also the metrics' label); ``RateLimitMiddleware`` charges
    only requests for routes that exist."""
    if path in IMAGE_ROUTES or OIP_INFER.match(path):
        return "classify"
    if method == "POST" and path.startswith("/v1/"):
        return "admin"
    return "read"


def route_exists(scope: Scope) -> bool:
    """Whether the app has a route for this path and method: anything else is answered
    404 or 405 without any work, so it is not charged. (Starlette puts the app in the
    scope before its middleware runs; without one, every request counts.)"""
    routes = getattr(getattr(scope.get("app"), "router", None), "routes", None)
    if routes is None:
        return True
    return any(route.matches(scope)[0] is Match.FULL for route in routes)


def client_key(scope: Scope) -> str:
    peer = scope.get("client") or ("unknown", 0)
    for name, value in scope["headers"]:
        if name == b"x-client-id":
            claimed = value.decode("latin-1")
            if _CLIENT_ID.match(claimed):
                return f"{peer[0]}/{claimed}"
    return str(peer[0])


def authorization(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return bytes(value).decode("latin-1")
    return ""


def listening_address(scope: Scope, host: str, port: int) -> tuple[str, int]:
    """The address and port this connection reached, as the server's socket reports it
    (``scope["server"]``); the configured ``host`` and ``port`` when the server sent none
    (a Unix socket, some test transports)."""
    server = scope.get("server")
    if server and server[0] and server[1]:
        return str(server[0]), int(server[1])
    return host, port
