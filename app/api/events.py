"""``GET /v1/events``: the live memory and queue samples, as Server-Sent Events.

A caller that sends the admin token (the tray) or a dashboard session may use the slot
kept for it (``app.http.live_feed.KEPT``), and is its own client for the per-client cap
whatever ``X-Client-Id`` it claims, as for the rate limiter: a program without either
cannot spend those slots."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.errors import Overloaded, Unauthorized
from app.gates.admin_token import check_bearer
from app.http.live_feed import SESSION, TOKEN, LiveFeed, NoRoom, Subscriber
from app.http.scope import ADMIN_CALLER, authorization, client_key
from app.http.state import state_of

router = APIRouter()


class EventStream(StreamingResponse):
    """A subscriber's stream that gives its slot back however the answer ends, even if
    the stream never started (the client left first)."""

    def __init__(self, hub: LiveFeed, subscriber: Subscriber) -> None:
        super().__init__(hub.stream(subscriber), media_type="text/event-stream",
                         headers={"Cache-Control": "no-store"})
        self.hub = hub
        self.subscriber = subscriber

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.hub.release(self.subscriber)


def proof_of(request: Request) -> str:
    """What the caller proved: the admin token (TOKEN), a dashboard session (SESSION), or
    nothing (""): a wrong or missing one only costs it the kept slots."""
    header = authorization(request.scope)
    scheme, _, given = header.partition(" ")
    if not given.strip() or scheme.lower() != "bearer":
        return ""
    state = state_of(request)
    if state.ui_sessions.valid(given.strip()):
        return SESSION
    try:
        check_bearer(header, state.admin_token.current())
    except Unauthorized:
        return ""
    return TOKEN


@router.get("/v1/events", summary="Live memory and queue samples (Server-Sent Events)",
            response_class=StreamingResponse)
async def events(request: Request) -> StreamingResponse:
    hub = state_of(request).feed
    proof = proof_of(request)
    client = client_key(request.scope) + (ADMIN_CALLER if proof else "")
    try:  # the slot is taken here, before anything awaits
        subscriber = hub.subscribe(client, proof)
    except NoRoom as full:
        if full.per_client:
            raise Overloaded("This program has too many live views open. Close one and try "
                             "again.", retry_after=5) from None
        raise Overloaded("Too many live views are open. Close one and try again.",
                         retry_after=5) from None
    return EventStream(hub, subscriber)
