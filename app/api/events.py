"""``GET /v1/events``: the live memory and queue samples, as Server-Sent Events."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.errors import Overloaded
from app.http.live_feed import LiveFeed, NoRoom, Subscriber
from app.http.scope import client_key
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


@router.get("/v1/events", summary="Live memory and queue samples (Server-Sent Events)",
            response_class=StreamingResponse)
async def events(request: Request) -> StreamingResponse:
    hub = state_of(request).feed
    try:  # the slot is taken here, before anything awaits
        subscriber = hub.subscribe(client_key(request.scope))
    except NoRoom as full:
        if full.per_client:
            raise Overloaded("This program has too many live views open. Close one and try "
                             "again.", retry_after=5) from None
        raise Overloaded("Too many live views are open. Close one and try again.",
                         retry_after=5) from None
    return EventStream(hub, subscriber)
