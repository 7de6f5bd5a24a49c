"""What vramguard adds to Ray Serve's HTTP proxy: a request lost with its replica is
answered like vramguard's other refusals, a JSON 503 with Retry-After, instead of the
proxy's bare 500.

When a replica dies (killed, crashed, its node gone) with requests inside it, the proxy
gets the actor error and sends nothing (ray 2.60.0, ``ray/serve/_private/http_util.py``:
``send_http_response_on_exception`` writes a body only for 408, 429 and 503); its uvicorn
then answers "Internal Server Error" in plain text, with no hint that sending again
works. Sending again does work: new requests go to the replicas left, and Serve replaces
the dead one.

Serve applies these middlewares when every node's Ray is started with
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=app.cluster.proxy:middlewares`` in its
environment (the proxy actors inherit it; ``serve run`` starts a local Ray from the
shell it runs in). Without it everything works the same, lost requests answer 500.
"""

from __future__ import annotations

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import ApiError
from app.gates import error_response

RETRY_AFTER_S = 1  # Serve routes the next request to a live replica at once


class ReplicaLost(ApiError):
    status, code = 503, "replica_lost"


class LostReplicaAnswer:
    """ASGI middleware around the proxy: a request the proxy returns from without any
    answer gets 503 ``replica_lost`` with Retry-After."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, receive, watch)
        if not started:
            error = ReplicaLost("The replica handling this request stopped before it "
                                "answered. The others are still serving: send it again.",
                                retry_after=RETRY_AFTER_S)
            await error_response(error, scope["path"])(scope, receive, send)


def middlewares() -> list[Middleware]:
    """Serve's proxy callback (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``)."""
    return [Middleware(LostReplicaAnswer)]
