"""The API key gate in process: nothing changes without a key; with one, every request but
the health checks (and the identity challenge) needs it, or the admin token, or a
dashboard session; refusals cost no rate-limit token; unusable key files stop the start."""

from __future__ import annotations

import hmac
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from api_key_file import KEY, key_file
from asgi import (
    built_app,
    client,
    error_message,
    state_of,
)
from fastapi import FastAPI
from starlette.types import Message, Scope

from app.gates.api_key import ApiKeyFileError, ApiKeyGate, load_api_key
from app.http.stats import RequestStats

HEALTH_CHECKS = ["/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"]


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[FastAPI]:
    """The real app, its engine ready, with an API key and a read burst of 3."""
    with built_app(tmp_path, ready=True, api_key_file=key_file(tmp_path),
                   read_burst=3, read_per_s=0.001,
                   cors_origins=["http://localhost:3000"]) as app:
        yield app


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@pytest.mark.anyio
async def test_without_a_key_file_nothing_asks_for_one(tmp_path: Path) -> None:
    with built_app(tmp_path, ready=True) as app:
        assert ApiKeyGate not in [layer.cls for layer in app.user_middleware]
        async with client(app) as http:
            assert (await http.get("/v1/stats")).status_code == 200


@pytest.mark.anyio
@pytest.mark.parametrize("headers", [{}, bearer("wrong" * 10), bearer(KEY + "x"),
                                     {"Authorization": f"Basic {KEY}"}, {"X-Api-Key": KEY}])
async def test_without_the_right_key_is_401_with_www_authenticate(keyed: FastAPI,
                                                                  headers: dict[str, str]
                                                                  ) -> None:
    async with client(keyed) as http:
        response = await http.get("/v1/stats", headers=headers)
    message = error_message(response, 401, "unauthorized")
    assert "API key" in message and "Authorization: Bearer" in message
    assert response.headers["WWW-Authenticate"] == "Bearer"


@pytest.mark.anyio
async def test_with_the_key_requests_pass(keyed: FastAPI) -> None:
    async with client(keyed) as http:
        models = await http.get("/v1/stats", headers=bearer(KEY))
        lower = await http.get("/v1/stats", headers={"Authorization": f"bearer {KEY}"})
    assert models.status_code == 200 and lower.status_code == 200


@pytest.mark.anyio
async def test_under_v2_the_401_has_the_open_inference_protocols_shape(keyed: FastAPI) -> None:
    async with client(keyed) as http:
        refused = await http.get("/v2")
        passed = await http.get("/v2", headers=bearer(KEY))
    assert refused.status_code == 401 and set(refused.json()) == {"error"}
    assert "API key" in refused.json()["error"]
    assert refused.headers["WWW-Authenticate"] == "Bearer"
    assert passed.status_code == 200


@pytest.mark.anyio
async def test_health_checks_and_the_identity_challenge_need_no_key(keyed: FastAPI) -> None:
    async with client(keyed) as http:
        checks = [await http.get(path, headers={"X-Client-Id": path.replace("/", "-")})
                  for path in HEALTH_CHECKS]
        identity = await http.post("/v1/identity", json={"nonce": "ab" * 32})
    assert [c.status_code for c in checks] == [200, 200, 200, 200]
    assert identity.status_code == 200 and "proof" in identity.json()


@pytest.mark.anyio
async def test_the_admin_token_and_a_dashboard_session_pass_in_its_place(keyed: FastAPI
                                                                        ) -> None:
    state = state_of(keyed)
    session = state.ui_sessions.redeem(state.ui_sessions.new_code())
    assert session is not None
    async with client(keyed) as http:
        admin = await http.post("/v1/admin/pause", headers=bearer(state.admin_token.current()))
        read = await http.get("/v1/stats", headers=bearer(session))
        resumed = await http.post("/v1/admin/resume", headers=bearer(session))
        beyond = await http.post("/v1/admin/ui-link", headers=bearer(session))
        keyed_admin = await http.post("/v1/admin/resume", headers=bearer(KEY))
    assert admin.status_code == 200 and admin.json() == {"paused": True}
    assert read.status_code == 200
    assert resumed.status_code == 200  # a tray-menu action: a session may
    error_message(beyond, 403, "forbidden")  # past the key gate; a new link it may not
    error_message(keyed_admin, 401, "unauthorized")  # the key is not the admin token


@pytest.mark.anyio
async def test_the_key_is_compared_in_constant_time(keyed: FastAPI,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[Any, Any]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    async with client(keyed) as http:
        assert (await http.get("/v1/stats", headers=bearer(KEY))).status_code == 200
        assert (await http.get("/v1/stats", headers=bearer("x" * 40))).status_code == 401
    assert (KEY.encode(), KEY.encode()) in compared
    assert (b"x" * 40, KEY.encode()) in compared


@pytest.mark.anyio
async def test_refusals_cost_no_token_and_are_counted(keyed: FastAPI) -> None:
    """A stranger behind the same address (a proxy's) cannot empty a client's bucket."""
    async with client(keyed) as http:
        for _ in range(10):
            assert (await http.get("/v1/stats", headers=bearer("x" * 40))).status_code == 401
        answers = [await http.get("/v1/stats", headers=bearer(KEY)) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert answers[-1].headers["RateLimit-Remaining"] == "0"  # a burst of 3, all its own
    assert state_of(keyed).limiter.rejected == 0
    assert state_of(keyed).stats.snapshot() == {"unauthorized": 10}


@pytest.mark.anyio
async def test_a_web_page_gets_its_preflight_and_a_401_it_can_read(keyed: FastAPI) -> None:
    origin = {"Origin": "http://localhost:3000"}
    async with client(keyed) as http:
        preflight = await http.options("/v1/stats", headers={
            **origin, "Access-Control-Request-Method": "GET",
            "Access-Control-Request-Headers": "authorization"})
        refused = await http.get("/v1/stats", headers=origin)
    assert preflight.status_code == 200
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == "http://localhost:3000"


@pytest.mark.anyio
async def test_a_websocket_without_the_key_is_closed() -> None:
    sent: list[Message] = []

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        raise AssertionError("reached the app")

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "websocket.connect"}

    gate = ApiKeyGate(app, key=KEY, is_admin=lambda header: False, stats=RequestStats())
    await gate({"type": "websocket", "path": "/v1/anything", "headers": []}, receive, send)
    assert sent == [{"type": "websocket.close", "code": 1008}]


@pytest.mark.anyio
async def test_through_a_tls_proxy_under_a_public_name(tmp_path: Path) -> None:
    """The documented set-up: the public name in allowed_hosts, the proxy passing on Host
    (and our own pages' Origin), the key in every request."""
    with built_app(tmp_path, ready=True, api_key_file=key_file(tmp_path),
                   allowed_hosts=["vision.example.com"]) as app:
        async with client(app, base_url="https://vision.example.com") as http:
            passed = await http.get("/v1/stats", headers={
                **bearer(KEY), "Origin": "https://vision.example.com"})
            refused = await http.get("/v1/stats")
    assert passed.status_code == 200
    error_message(refused, 401, "unauthorized")


# --- the key file ---------------------------------------------------------------------


def test_the_key_is_read_without_its_newline(tmp_path: Path) -> None:
    assert load_api_key(key_file(tmp_path)) == KEY


@pytest.mark.parametrize(("text", "mode", "expected"), [
    (None, 0o600, "does not exist"),
    ("  \n", 0o600, "is empty"),
    ("short-key\n", 0o600, "has 9 characters"),
    ("a key with spaces that is long enough to pass\n", 0o600, "without spaces"),
    (KEY + "\nsecond line\n", 0o600, "one line"),
    pytest.param(KEY, 0o644, "chmod 600", marks=pytest.mark.skipif(
        sys.platform == "win32", reason="POSIX permissions")),
    pytest.param(KEY, 0o640, "other users", marks=pytest.mark.skipif(
        sys.platform == "win32", reason="POSIX permissions")),
])
def test_an_unusable_key_file_stops_the_app_with_what_to_fix(tmp_path: Path, text: str | None,
                                                             mode: int, expected: str) -> None:
    path = tmp_path / "api-key" if text is None else key_file(tmp_path, text, mode)
    with pytest.raises(ApiKeyFileError, match=expected) as info, built_app(
            tmp_path, api_key_file=path):
        pass
    assert str(path) in str(info.value)


def test_a_folder_in_place_of_the_key_file_is_one_message(tmp_path: Path) -> None:
    with pytest.raises(ApiKeyFileError, match="Cannot read the API key file"):
        load_api_key(tmp_path)
