"""Programs that answer on vramguard's port instead of vramguard (attack material for the
tray, `vramguard stop` and the second launch), and the real app served from a thread.

A squatter is what the tray meets when vramguard is down, restarting, or lost the race
for its port: a real HTTP server on 127.0.0.1 that answers whatever it is asked and keeps
every request it was sent, so a test can show that no token and no action reached it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from asgi import built_app
from fastapi import FastAPI

EVIL_URL = "file:///C:/Users/Public/evil.exe"


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes


Answer = Callable[[Received, int], tuple[int, dict[str, Any]]]


def gullible(request: Received, port: int) -> tuple[int, dict[str, Any]]:
    """Says yes to everything, with an answer shaped like vramguard's: a made-up proof, a
    dashboard 'link' that is a program to run."""
    return 200, {"proof": "0" * 64, "url": EVIL_URL, "code": "x" * 32, "paused": True,
                 "freed_bytes": 0, "status": "shutting down"}


def identity_proof(token: str, nonce_hex: str, port: int,
                   address: bytes = bytes([127, 0, 0, 1])) -> str:
    """The protocol, written out independently of the app: HMAC-SHA256 keyed with the admin
    token over the nonce's 32 bytes, one byte for the address's length, the address (an
    IP address's packed bytes: 127.0.0.1 here, where squatters listen) and the port as
    two big-endian bytes."""
    message = bytes.fromhex(nonce_hex) + bytes([len(address)]) + address + \
        port.to_bytes(2, "big")
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def knowing(token: str, url: str = EVIL_URL, code: str = "c" * 32) -> Answer:
    """A server that knows the token (it passes the challenge) but hands out a dashboard
    'url' of its own choosing: the tray must still open only what it builds."""

    def answer(request: Received, port: int) -> tuple[int, dict[str, Any]]:
        if request.path == "/v1/identity":
            nonce = json.loads(request.body)["nonce"]
            return 200, {"proof": identity_proof(token, nonce, port)}
        return 200, {"url": url, "code": code, "paused": True}

    return answer


@dataclass
class Squatter:
    """An HTTP server on a free 127.0.0.1 port answering with ``answer``."""

    answer: Answer = gullible
    received: list[Received] = field(default_factory=list)
    port: int = 0  # 0: a free one (a relay takes the port its target has on the other family)

    def __post_init__(self) -> None:
        squatter = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                request = Received(self.command, self.path,
                                   {k.lower(): v for k, v in self.headers.items()},
                                   self.rfile.read(length))
                squatter.received.append(request)
                status, body = squatter.answer(request, squatter.port)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _any

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = int(self._server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> Squatter:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def with_token(self) -> list[Received]:
        """The requests that carried an Authorization header (a token handed over)."""
        return [r for r in self.received if "authorization" in r.headers]

    def paths(self) -> list[str]:
        return [r.path for r in self.received]


def relay_to(target: str, statuses: list[int]) -> Answer:
    """Pass every request on to ``target`` (a real vramguard on another port), as a
    squatter that wants the real server to answer its challenge would, and hand the real
    answer back; keep the real statuses in ``statuses``."""

    def answer(request: Received, port: int) -> tuple[int, dict[str, Any]]:
        headers = {k: v for k, v in request.headers.items()
                   if k not in ("host", "content-length", "connection")}
        upstream = httpx.request(request.method, target + request.path,
                                 headers=headers, content=request.body)
        statuses.append(upstream.status_code)
        return upstream.status_code, upstream.json()

    return answer


@dataclass
class Served:
    url: str
    port: int
    app: FastAPI
    token_file: Path


@contextmanager
def served_app(tmp_path: Path, host: str = "127.0.0.1", **overrides: Any) -> Iterator[Served]:
    """The real app (a ReadyEngine: no model) behind uvicorn on a free port of ``host``
    (127.0.0.1 or ::1), in a thread, its settings' host and port those it listens on: a
    real vramguard for tests that need real sockets but not the model."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.bind((host, 0))
    port = int(listener.getsockname()[1])
    with built_app(tmp_path, ready=True, host=host, port=port, **overrides) as app:
        server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]},
                                  daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "the threaded server did not start"
            time.sleep(0.01)
        try:
            where = f"[{host}]" if ":" in host else host
            yield Served(f"http://{where}:{port}", port, app,
                         app.state.vg.settings.token_file)
        finally:
            server.should_exit = True
            thread.join(10)
            listener.close()
