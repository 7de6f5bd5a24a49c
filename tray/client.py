"""The tray's only way to the server: its HTTP API, with the admin token from the
per-user token file."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from app.gates.admin_token import load_or_create_token
from app.schemas import LiveSample, MemoryReport, StatsResponse


class ServerDown(Exception):
    """The server does not answer (not running, starting, or crashed)."""


class ApiClient:
    def __init__(self, base_url: str, token_file: Path, timeout: float = 3.0) -> None:
        self.base_url = base_url
        self.token_file = token_file
        self._http = httpx.Client(base_url=base_url, timeout=timeout,
                                  headers={"X-Client-Id": "vramguard-tray"})

    def _call(self, method: str, path: str, admin: bool = False) -> dict[str, Any]:
        headers = {}
        if admin:
            headers["Authorization"] = f"Bearer {load_or_create_token(self.token_file)}"
        try:
            response = self._http.request(method, path, headers=headers)
        except httpx.TransportError as exc:
            raise ServerDown(str(exc)) from None
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:200]
            raise ServerDown(message) if response.status_code == 503 else RuntimeError(message)
        body = response.json()
        if not isinstance(body, dict):
            raise RuntimeError(f"unexpected answer from {path}: {response.text[:200]}")
        return body

    def sample(self) -> LiveSample:
        """Memory and queue figures in one sample (what the icon and menu show), read from
        /v1/memory and /v1/stats: the same fields as a live event's."""
        memory = MemoryReport.model_validate(self._call("GET", "/v1/memory"))
        stats = StatsResponse.model_validate(self._call("GET", "/v1/stats"))
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

    def dashboard_link(self) -> str:
        """A one-time link that opens the dashboard with its Empty-cache button enabled."""
        return str(self._call("POST", "/v1/admin/ui-link", admin=True)["url"])

    def shutdown(self) -> dict[str, Any]:
        return self._call("POST", "/v1/admin/shutdown", admin=True)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
