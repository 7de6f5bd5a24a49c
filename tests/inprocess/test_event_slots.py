"""The live-view slots kept for the tray and the dashboard (``app/http/live_feed.py``,
``app/api/events.py``), in process: a program rotating ``X-Client-Id``s takes every slot
open to it, and the tray (the admin token) and the dashboard (its session) still get
theirs. The same over real sockets: ``tests/live/test_event_slots_live.py``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from asgi import built_app, client, state_of, until
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.http.live_feed import KEPT, MAX_STREAMS_PER_CLIENT, MAX_SUBSCRIBERS

pytestmark = pytest.mark.anyio
OPEN_TO_ANYONE = MAX_SUBSCRIBERS - len(KEPT)


def recording(app: ASGIApp, statuses: list[int]) -> ASGIApp:
    """``app``, noting each answer's status as it starts (a stream never ends by itself)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
            await send(message)

        await app(scope, receive, watch)

    return wrapped


async def test_rotating_client_ids_leave_the_tray_and_the_dashboard_their_slots(
        tmp_path: Path) -> None:
    statuses: list[int] = []
    with built_app(tmp_path, ready=True) as app:
        hub = state_of(app).feed
        token = {"Authorization": f"Bearer {state_of(app).admin_token.current()}"}
        opening: list[asyncio.Future[httpx.Response]] = []
        async with client(recording(app, statuses)) as http:

            async def status(headers: dict[str, str]) -> int:
                """Open one stream with ``headers``; its status once it has answered."""
                seen = len(statuses)
                opening.append(asyncio.ensure_future(http.get("/v1/events", headers=headers)))
                await until(lambda: len(statuses) > seen)
                return statuses[seen]

            link = await http.post("/v1/admin/ui-link", headers=token)
            redeemed = await http.post("/v1/ui/session", json={"code": link.json()["code"]})
            session = {"Authorization": f"Bearer {redeemed.json()['token']}"}
            # the program fills the tray's id and the browser's (none), then rotates ids
            claims = [{"X-Client-Id": "vramguard-tray"}, {}] * MAX_STREAMS_PER_CLIENT
            claims += [{"X-Client-Id": f"id-{i}"} for i in range(40 - len(claims))]
            try:
                flood = [await status(claim) for claim in claims]
                wrong = await status({"X-Client-Id": "id-x", "Authorization": "Bearer guess"})
                tray = await status({"X-Client-Id": "vramguard-tray", **token})
                dashboard = await status(session)
                after = [await status({"X-Client-Id": "id-y"}),
                         await status({"X-Client-Id": "vramguard-tray", **token})]
                held = len(hub.subscribers)
            finally:
                hub.close()
                answers = await asyncio.gather(*opening, return_exceptions=True)
    assert all(isinstance(a, httpx.Response) for a in answers), answers
    assert flood.count(200) == OPEN_TO_ANYONE and flood.count(503) == 40 - OPEN_TO_ANYONE
    assert set(flood[:2 * MAX_STREAMS_PER_CLIENT]) == {200}  # the tray's id, the browser's
    assert wrong == 503  # a wrong token is no proof
    assert tray == 200 and dashboard == 200
    assert after == [503, 503]  # every slot taken: the kept ones by their own
    assert held == MAX_SUBSCRIBERS
