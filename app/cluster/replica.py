"""One cluster replica's two faces over one engine, without Ray (app/cluster/serve_app.py
puts them in a Serve deployment).

- The public face goes behind Serve's proxy: the inference routes (``PUBLIC_PATHS`` and
  the Open Inference Protocol under /v2) and the health checks, with the appliance's
  gates, JSON errors and status codes. The proxy spreads requests over the replicas, so a
  route whose answer belongs to one process (admin calls, /v1/events, /ui, /v1/memory,
  /v1/stats, /metrics, the identity and dashboard handshakes) would answer for a random
  replica: through the proxy it gets a 404 JSON error saying how replicas' ports are
  chosen (``replica_port`` plus the rank on the node), never the answering one's address.
- The replica's own port (``side_port``: ``replica_port`` plus the replica's rank on its
  node, on ``host``) serves those per-process routes, /metrics for Prometheus to scrape
  each replica directly, and the read-only public ones (health, /v1/models: what this
  replica has loaded). Images sent there get a 404 naming the proxy: they go through it,
  to be spread over the replicas and counted by the autoscaler. It is a second app over
  the same state (``app_over``), so both faces count into the same stats and metrics and
  take tokens from the same limiter.

``POST /v1/admin/shutdown`` is refused on the replica's port: Serve starts and stops
replicas (``serve shutdown``, or fewer replicas in the config); a replica that stopped
itself would only be started again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator

import uvicorn
from fastapi import FastAPI
from starlette.routing import Match
from starlette.types import Message, Receive, Scope, Send

from app.config import Settings
from app.errors import NotFound
from app.gates import OIP_PREFIX, refuse
from app.gates.rate_limit import Limiter
from app.http.scope import IMAGE_ROUTES, OIP_INFER
from app.http.server import app_over, make_state
from app.http.state import AppState

log = logging.getLogger("vramguard.cluster")
PUBLIC_PATHS = frozenset({"/v1/classify", "/v1/classify/stream", "/v1/embed", "/v1/models",
                          "/healthz", "/readyz"})
SERVE_STOPS_REPLICAS = frozenset({"/v1/admin/shutdown"})


def is_public(path: str) -> bool:
    """Whether the proxy may pass ``path`` to any replica: the answer does not depend on
    which one gets it."""
    return path in PUBLIC_PATHS or path == OIP_PREFIX or path.startswith(OIP_PREFIX + "/")


def side_port(replica_port: int, local_rank: int) -> int:
    """The replica's own port: deterministic, so that Prometheus and operators can list
    every replica's address from the config alone."""
    port = replica_port + local_rank
    if port > 65535:
        raise ValueError(f"replica_port {replica_port} leaves no port for replica "
                         f"{local_rank} of this node (ports end at 65535): lower it")
    return port


class RouteFilter:
    """ASGI: a request for one of the app's routes that ``keep`` refuses gets a 404 JSON
    error saying where it is served (``elsewhere``); everything else goes to the app, so
    unknown paths and wrong methods get the app's own 404 and 405."""

    def __init__(self, app: FastAPI, keep: Callable[[str], bool],
                 elsewhere: Callable[[str], str]) -> None:
        self.app = app
        self.keep = keep
        self.elsewhere = elsewhere

    def routed(self, scope: Scope) -> bool:
        return any(route.matches(scope)[0] is not Match.NONE for route in self.app.routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.keep(scope["path"]) and self.routed(scope):
            state: AppState = self.app.state.vg
            await refuse(NotFound(self.elsewhere(scope["path"])), state.stats, scope,
                         receive, send)
            return
        await self.app(scope, receive, send)


class _Server(uvicorn.Server):
    """uvicorn on the replica's running event loop; the process's signals stay Ray's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class SidePort:
    """The replica's own port: bound at once (a port in use fails the replica's start with
    a message saying so), served from the ASGI startup on the replica's event loop, closed
    at shutdown after ``on_exit`` (which ends the event streams: they never end alone)."""

    def __init__(self, app: RouteFilter, host: str, port: int, settings: Settings,
                 on_exit: Callable[[], None]) -> None:
        self.host, self.port = host, port
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        self.on_exit = on_exit
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
            self.socket.listen()  # held from now: a second bind fails (SO_REUSEADDR)
        except OSError as exc:
            self.socket.close()
            raise RuntimeError(f"this replica cannot listen on {host}:{port} for its own "
                               f"routes ({exc.strerror}): another program, or a replica "
                               "still stopping, holds it. Free the port or set replica_port "
                               "to a free range (one port per replica on a node).") from None
        self.server = _Server(uvicorn.Config(
            app, lifespan="off", http="h11", timeout_keep_alive=settings.idle_timeout_s,
            timeout_graceful_shutdown=int(settings.request_timeout_s) + 1,
            access_log=False, log_config=None))
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self.server.serve(sockets=[self.socket]), name=f"vramguard-replica-{self.port}")

    async def stop(self) -> None:
        if self._task is None:
            self.socket.close()
            return
        self.on_exit()
        self.server.should_exit = True
        try:
            await self._task
        except Exception:  # the replica stops anyway: its engine must still be stopped
            log.exception("the replica's own port %d did not close cleanly", self.port)


class Replica:
    """The engine's state and its two faces; ``asgi`` is what Serve runs (its lifespan
    starts the engine, then the replica's own port). ``close_limiter`` closes a shared
    limiter's connections once the app has stopped."""

    def __init__(self, settings: Settings, name: str, local_rank: int, *,
                 limiter: Limiter | None = None,
                 close_limiter: Callable[[], Awaitable[None]] | None = None) -> None:
        self.name = name
        self.state = make_state(settings, limiter=limiter)
        self.state.metrics.replica = name
        port = side_port(settings.replica_port, local_rank)
        self.own = RouteFilter(app_over(self.state, port=port, runs_lifespan=False),
                               self._served_here, self._not_here)
        self.side = SidePort(self.own, settings.host, port, settings, self.state.feed.close)
        self.public = RouteFilter(app_over(self.state), is_public, self._not_public)
        self.asgi = _Lifespan(self.public, self.side, close_limiter)
        log.info("replica %s serves its own routes (admin calls, /metrics, /v1/events, /ui, "
                 "/v1/memory, /v1/stats) at %s", name, self.side.url)

    @staticmethod
    def _served_here(path: str) -> bool:
        sends_images = path in IMAGE_ROUTES or OIP_INFER.match(path) is not None
        return not sends_images and path not in SERVE_STOPS_REPLICAS

    def _not_public(self, path: str) -> str:
        settings = self.state.settings
        # Anyone who reaches the proxy reads this (it comes before the key gate): it says
        # how replicas' ports are chosen (as the docs do), never this one's address.
        return (f"{path} belongs to one replica, so the proxy does not serve it. Each "
                "replica answers it on its own port on its node: replica_port "
                f"({settings.replica_port}) plus its rank on that node.")

    def _not_here(self, path: str) -> str:
        if path in SERVE_STOPS_REPLICAS:
            return ("Ray Serve starts and stops the replicas: use `serve shutdown`, or "
                    "lower the number of replicas in the Serve config.")
        return (f"Send images to {path} through the Ray Serve proxy (port "
                f"{self.state.settings.port}), which spreads them over the replicas: this "
                f"port serves replica {self.name}'s own routes (admin calls, /metrics, "
                "/v1/events, /ui, /v1/memory, /v1/stats) and its health.")


class _Lifespan:
    """The public face as Serve runs it: after the app's startup (the engine starts
    loading in the background) the replica's own port opens, so its /readyz shows the
    warmup; at shutdown that port closes first, then the app stops the engine, then the
    limiter's connections close."""

    def __init__(self, app: RouteFilter, side: SidePort,
                 close_limiter: Callable[[], Awaitable[None]] | None) -> None:
        self.app = app
        self.side = side
        self.close_limiter = close_limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def on_receive() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self.side.stop()
            return message

        async def on_send(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                self.side.start()
            if message["type"] == "lifespan.shutdown.complete" and self.close_limiter:
                await self.close_limiter()
            await send(message)

        await self.app(scope, on_receive, on_send)
