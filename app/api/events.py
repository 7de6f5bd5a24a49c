"""``GET /v1/events``: the live memory and queue samples, as Server-Sent Events."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from app.errors import Overloaded
from app.state import state_of

router = APIRouter()


@router.get("/v1/events", summary="Live memory and queue samples (Server-Sent Events)",
            response_class=StreamingResponse)
async def events(request: Request) -> StreamingResponse:
    hub = state_of(request).events
    if hub.full():
        raise Overloaded("Too many live views are open. Close one and try again.",
                         retry_after=5)
    return StreamingResponse(hub.stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store"})
