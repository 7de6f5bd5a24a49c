"""The tray's only way to the server: its HTTP API, with the admin token from the
per-user token file.

The token goes only to a server that has just proved it knows it: before each admin
call the client sends a fresh nonce to ``POST /v1/identity`` and checks the answer,
HMAC(token, nonce ‖ address ‖ port), against the address and port its connection really
reached. Whatever else answers there (a program that took the port while vramguard was
down, or one that passes the challenge on to a real vramguard elsewhere: another port,
or ``::1`` behind ``127.0.0.1``) gets no token and no action. ``vramguard stop`` and
the second launch use this client too.

Readings (``sample``) go without the token, unless the server asks for an API key
(``api_key_file``): its first 401 makes the client prove the server and send the admin
token, which the key gate accepts in the key's place, with every later reading.
"""

from __future__ import annotations

import hmac
import re
import secrets
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from app.host.token_file import (
    NONCE_BYTES,
    InsecureTokenFile,
    identity_proof,
    load_or_create_token,
)
from app.host.user_files import reason
from app.schemas import LiveSample, MemoryReport, StatsResponse

DASHBOARD_CODE = re.compile(r"[A-Za-z0-9_-]{16,128}", re.ASCII)
"""What a one-time dashboard code looks like (``secrets.token_urlsafe``); anything else
is not put in a page."""


class ServerDown(Exception):
    """The server does not answer (not running, starting, or crashed)."""


class NotVramguard(Exception):
    """Something answers on the port but cannot prove it is this user's vramguard."""


class Refused(RuntimeError):
    """The server answered with an error other than 503: its message, and its status (409
    when a model to unload is busy, 404 when it is not loaded, ...)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def answered_at(response: httpx.Response) -> tuple[str, int]:
    """The address and port that really answered: the connection's peer, else the URL's
    (a test transport has no socket)."""
    stream = response.extensions.get("network_stream")
    try:
        peer = stream.get_extra_info("server_addr") if stream is not None else None
    except OSError:  # closed since
        peer = None
    if isinstance(peer, tuple) and len(peer) >= 2:
        return str(peer[0]), int(peer[1])
    return response.url.host, response.url.port or 80


class ApiClient:
    def __init__(self, base_url: str, token_file: Path, timeout: float = 3.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url
        self.token_file = token_file
        self.port = httpx.URL(base_url).port or 80
        # trust_env=False: never a proxy of the environment or of Windows' settings
        # (httpx ignores their exception list for 127.0.0.1, encode/httpx#1536).
        self._http = httpx.Client(base_url=base_url, timeout=timeout, transport=transport,
                                  headers={"X-Client-Id": "vramguard-tray"}, trust_env=False)
        self.keyed = False  # the server answered a reading with 401: it asks for a key

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ServerDown(str(exc)) from None

    def _token(self) -> str:
        try:
            return load_or_create_token(self.token_file)
        except InsecureTokenFile as exc:
            raise RuntimeError(str(exc)) from None
        except OSError as exc:
            raise RuntimeError(f"cannot read the admin token file {self.token_file}: "
                               f"{reason(exc)}") from None

    def _prove(self, token: str) -> None:
        """Make whatever answers on the port prove that it knows ``token`` for this port;
        NotVramguard (and nothing sent) when it cannot."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        response = self._request("POST", "/v1/identity", json={"nonce": nonce.hex()})
        if response.status_code in (429, 503):
            raise ServerDown(f"vramguard on port {self.port} is busy; try again in a moment")
        try:
            proof = response.json()["proof"]
        except (ValueError, KeyError, TypeError):
            proof = None
        expected = identity_proof(token, nonce, *answered_at(response))
        if response.status_code != 200 or not isinstance(proof, str) or \
                not hmac.compare_digest(proof.encode(), expected.encode()):
            raise NotVramguard(f"Another program is answering on port {self.port}; "
                               "vramguard is not running there (or it uses another "
                               "admin-token file). Nothing was sent to it.")

    def proven_token(self) -> str:
        """The admin token, once the server on the port has proved it knows it (what admin
        calls send, and the event stream for its kept slot)."""
        token = self._token()
        self._prove(token)
        return token

    def _call(self, method: str, path: str, admin: bool = False,
              token: str | None = None) -> dict[str, Any]:
        """``admin``: prove the server, then send the token; ``token``: one already proven
        for this call."""
        headers = {}
        if admin:
            token = self.proven_token()
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        response = self._checked(self._request(method, path, headers=headers))
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise RuntimeError(f"unexpected answer from {path}: {response.text[:200]}")
        return body

    @staticmethod
    def _checked(response: httpx.Response) -> httpx.Response:
        """The response, unless it is a refusal: ServerDown for 503, else Refused."""
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:200]
            if response.status_code == 503:
                raise ServerDown(message)
            raise Refused(message, response.status_code)
        return response

    def support_report(self) -> bytes:
        """The support report's zip file (``/v1/support-report``), from the proven server."""
        headers = {"Authorization": f"Bearer {self.proven_token()}"}
        response = self._checked(self._request("GET", "/v1/support-report", headers=headers,
                                               timeout=60))
        if response.headers.get("content-type") != "application/zip":
            raise RuntimeError("vramguard did not answer with a support report")
        return response.content

    def sample(self) -> LiveSample:
        """Memory and queue figures in one sample (what the icon and menu show), read from
        /v1/memory and /v1/stats: the same fields as a live event's. On a server that asks
        for an API key, with the proven admin token in its place."""
        try:
            token = self.proven_token() if self.keyed else None
            memory = MemoryReport.model_validate(self._call("GET", "/v1/memory", token=token))
            stats = StatsResponse.model_validate(self._call("GET", "/v1/stats", token=token))
        except Refused as exc:
            if exc.status != 401 or self.keyed:
                raise ServerDown(str(exc)) from None
            self.keyed = True  # read again, now with the token (once: keyed from here on)
            return self.sample()
        except ValueError:  # not vramguard's answer: nothing to show
            raise ServerDown(f"the program on port {self.port} does not answer like "
                             "vramguard") from None
        except (RuntimeError, NotVramguard) as exc:  # refused (rate limited, say), or not
            raise ServerDown(str(exc)) from None  # ours: no reading this time
        return LiveSample(
            **memory.model_dump(), t=time.time(), queue_depth=stats.queue_depth,
            in_flight=stats.in_flight, batches=stats.batches,
            mean_batch_size=stats.mean_batch_size, paused=stats.paused,
            requests=stats.requests, rate_limited=stats.rate_limited)

    def empty_cache(self) -> dict[str, Any]:
        return self._call("POST", "/v1/memory/empty-cache", admin=True)

    def reset_peak(self) -> dict[str, Any]:
        return self._call("POST", "/v1/memory/reset-peak", admin=True)

    def set_paused(self, paused: bool) -> dict[str, Any]:
        return self._call("POST", "/v1/admin/pause" if paused else "/v1/admin/resume",
                          admin=True)

    def unload_model(self, name: str) -> dict[str, Any]:
        """Unload a loaded model now (Refused with 409 while it has images, 404 when it is
        not loaded). The name is one the server listed; it is quoted as one path part."""
        return self._call("POST", f"/v1/models/{quote(name, safe='')}/unload", admin=True)

    def dashboard_code(self) -> str:
        """A one-time code that signs the dashboard in. Only the code is taken from the
        answer, never its ``url``: what the browser opens is built by the caller."""
        code = self._call("POST", "/v1/admin/ui-link", admin=True).get("code")
        if not isinstance(code, str) or not DASHBOARD_CODE.fullmatch(code):
            raise RuntimeError("vramguard did not give a usable dashboard code")
        return code

    def shutdown(self) -> dict[str, Any]:
        return self._call("POST", "/v1/admin/shutdown", admin=True)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
