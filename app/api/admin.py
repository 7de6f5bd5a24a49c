"""Admin actions on the appliance itself: pause, resume, shut down (bearer token)."""

from __future__ import annotations

import asyncio
import signal

from fastapi import APIRouter, Depends, Request

from app.gates.admin_token import require_admin
from app.schemas import ErrorResponse
from app.state import state_of

router = APIRouter(dependencies=[Depends(require_admin)],
                   responses={401: {"model": ErrorResponse}})


@router.post("/v1/admin/pause", summary="Stop taking images (they get 503) (admin)")
async def pause(request: Request) -> dict[str, bool]:
    state_of(request).engine.paused = True
    return {"paused": True}


@router.post("/v1/admin/resume", summary="Take images again (admin)")
async def resume(request: Request) -> dict[str, bool]:
    state_of(request).engine.paused = False
    return {"paused": False}


@router.post("/v1/admin/shutdown", summary="Finish what is queued, then exit (admin)")
async def shutdown() -> dict[str, str]:
    # The same path as Ctrl+C: uvicorn stops accepting, drains, runs the lifespan's
    # shutdown and exits 0. Raised after this answer has gone out.
    asyncio.get_running_loop().call_later(0.2, signal.raise_signal, signal.SIGINT)
    return {"status": "shutting down"}
