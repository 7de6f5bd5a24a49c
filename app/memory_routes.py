"""Memory endpoints: the readings anyone local may see, and the admin actions."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from app.errors import NotReady
from app.guard.admin_token import require_admin
from app.routes import state_of
from app.schemas import ErrorResponse

router = APIRouter()
_ADMIN = {"dependencies": [Depends(require_admin)],
          "responses": {401: {"model": ErrorResponse}, 503: {"model": ErrorResponse}}}


def _engine(request: Request) -> Any:
    engine = state_of(request).engine
    if engine.guard is None:
        raise NotReady(engine.not_ready_message(), retry_after=5)
    return engine


@router.get("/v1/memory", summary="Device memory, budget, watermarks and guard state")
async def memory(request: Request) -> dict[str, Any]:
    engine = state_of(request).engine
    return await engine.on_device(engine.memory_report)  # type: ignore[no-any-return]


@router.post("/v1/memory/empty-cache", summary="Give cached memory back (admin)", **_ADMIN)
async def empty_cache(request: Request) -> dict[str, int]:
    engine = _engine(request)
    before, after = await engine.on_device(engine.release)
    return {"reserved_before_bytes": before, "reserved_after_bytes": after,
            "freed_bytes": max(0, before - after)}


@router.post("/v1/memory/reset-peak", summary="Start measuring peaks afresh (admin)", **_ADMIN)
async def reset_peak(request: Request) -> dict[str, int]:
    engine = _engine(request)
    before, after = await engine.on_device(engine.reset_peak)
    return {"peak_allocated_before_bytes": before, "peak_allocated_after_bytes": after}
