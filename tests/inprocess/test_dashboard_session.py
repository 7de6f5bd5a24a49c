"""What a dashboard session (bought with the one-time code) may do: what the tray menu
does (empty the cache, reset the peak, pause, resume, unload, stop), nothing else; it
ends at a hard limit and cannot renew itself. And the challenge the tray sends before it
trusts a server with the token. In-process."""

from __future__ import annotations

import hashlib
import hmac
import signal

import anyio
import pytest
from asgi import built_app, client, error_message

from app.gates.ui_session import UiSessions

pytestmark = pytest.mark.anyio
HOURS = 3600.0


async def session_for(http, admin: dict[str, str]) -> dict[str, str]:
    """What a page opened from the tray holds: a session token for its Bearer header."""
    link = await http.post("/v1/admin/ui-link", headers=admin)
    assert link.status_code == 200, link.text
    code = link.json()["url"].split("#code=")[1]
    session = await http.post("/v1/ui/session", json={"code": code})
    assert session.status_code == 200, session.text
    return {"Authorization": f"Bearer {session.json()['token']}"}


async def test_a_dashboard_session_can_do_what_the_tray_menu_does_and_nothing_more(
        tmp_path, monkeypatch):
    raised: list[int] = []  # a shutdown that got through would stop the test run
    monkeypatch.setattr(signal, "raise_signal", raised.append)
    with built_app(tmp_path) as app:
        admin = {"Authorization": f"Bearer {app.state.vg.admin_token.current()}"}
        async with client(app) as http:
            session = await session_for(http, admin)
            for path in ("/v1/admin/ui-link", "/v1/memory/record-history?seconds=1",
                         "/v1/models/efficientnet_lite0/load"):
                refused = await http.post(path, headers=session)
                message = error_message(refused, 403, "forbidden")
                assert "admin token" in message, path
            for path in ("/v1/memory/empty-cache", "/v1/memory/reset-peak"):
                allowed = await http.post(path, headers=session)  # past the check: the
                error_message(allowed, 503, "not_ready")  # model is not loaded here
            unload = await http.post("/v1/models/efficientnet_lite1/unload", headers=session)
            error_message(unload, 404, "not_found")  # past the check: it is not loaded
            assert (await http.post("/v1/admin/pause", headers=session)).json() == {
                "paused": True}
            assert app.state.vg.engine.paused is True
            assert (await http.post("/v1/admin/resume", headers=session)).json() == {
                "paused": False}
            stopping = await http.post("/v1/admin/shutdown", headers=session)
            assert stopping.json() == {"status": "shutting down"}
            await anyio.sleep(0.5)  # the signal is raised 0.2 s after the answer
            assert raised == [signal.SIGINT]


async def test_a_session_cannot_renew_itself(tmp_path):
    with built_app(tmp_path) as app:
        admin = {"Authorization": f"Bearer {app.state.vg.admin_token.current()}"}
        async with client(app) as http:
            session = await session_for(http, admin)
            renewal = await http.post("/v1/admin/ui-link", headers=session)
            error_message(renewal, 403, "forbidden")  # no new code, so no new session


def test_a_session_ends_at_its_hard_limit_however_much_it_is_used() -> None:
    now = [0.0]
    sessions = UiSessions(clock=lambda: now[0])
    token = sessions.redeem(sessions.new_code())
    assert token is not None
    while now[0] < 8 * HOURS - 60:
        assert sessions.valid(token)
        now[0] += 600
    now[0] = 8 * HOURS + 1
    assert not sessions.valid(token)


def test_a_code_works_once_and_not_after_two_minutes() -> None:
    now = [0.0]
    sessions = UiSessions(clock=lambda: now[0])
    code = sessions.new_code()
    late = sessions.new_code()
    assert sessions.redeem(code) is not None and sessions.redeem(code) is None
    now[0] = 121
    assert sessions.redeem(late) is None


async def test_the_server_proves_it_knows_the_token_for_its_own_address(tmp_path):
    """The proof binds the address and port the connection reached (the listening
    socket's: ASGI's ``server``), written out here as the protocol says."""
    with built_app(tmp_path, port=8766) as app:
        token = app.state.vg.admin_token.current()
        nonce = bytes(range(32))
        async with client(app, base_url="http://127.0.0.1:8766") as http:
            answer = await http.post("/v1/identity", json={"nonce": nonce.hex()})
            assert answer.status_code == 200, answer.text
            message = nonce + b"\x04" + bytes([127, 0, 0, 1]) + (8766).to_bytes(2, "big")
            expected = hmac.new(token.encode(), message, hashlib.sha256).hexdigest()
            assert answer.json() == {"proof": expected}
            assert token not in answer.text
            for bad in ("", "00", "zz" * 32, nonce.hex() + "00"):
                refused = await http.post("/v1/identity", json={"nonce": bad})
                error_message(refused, 400, "bad_request")
