"""Memory endpoints: the readings anyone local may see, and the admin actions."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated, Any

import platformdirs
import torch
from fastapi import APIRouter, Depends, Query, Request

from app.config import APP_NAME
from app.errors import Conflict, NotReady
from app.guard.admin_token import require_admin
from app.routes import state_of
from app.schemas import ErrorResponse

router = APIRouter()
_ADMIN = {"dependencies": [Depends(require_admin)],
          "responses": {401: {"model": ErrorResponse}, 409: {"model": ErrorResponse},
                        503: {"model": ErrorResponse}}}


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
    engine.guard.counters.cache_empties += 1
    return {"reserved_before_bytes": before, "reserved_after_bytes": after,
            "freed_bytes": max(0, before - after)}


@router.post("/v1/memory/reset-peak", summary="Start measuring peaks afresh (admin)", **_ADMIN)
async def reset_peak(request: Request) -> dict[str, int]:
    engine = _engine(request)
    before, after = await engine.on_device(engine.reset_peak)
    return {"peak_allocated_before_bytes": before, "peak_allocated_after_bytes": after}


@router.post("/v1/memory/record-history", summary="Record allocator history (admin, GPU only)",
             **_ADMIN)
async def record_history(request: Request,
                         seconds: Annotated[float, Query(gt=0, le=300)] = 10) -> dict[str, Any]:
    """Record every CUDA allocation for ``seconds`` and write a snapshot file that
    PyTorch's memory visualizer (pytorch.org/memory_viz) opens."""
    engine = _engine(request)
    if engine.device.type != "cuda":
        raise Conflict("Allocator history exists only on an NVIDIA GPU; this appliance "
                       "runs on the CPU.")
    folder = Path(platformdirs.user_data_dir(APP_NAME, appauthor=False)) / "memory-snapshots"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / time.strftime("snapshot-%Y%m%d-%H%M%S.pickle")
    await engine.on_device(lambda: torch.cuda.memory._record_memory_history(max_entries=200_000))
    try:
        await asyncio.sleep(seconds)
        await engine.on_device(lambda: torch.cuda.memory._dump_snapshot(str(path)))
    finally:
        await engine.on_device(lambda: torch.cuda.memory._record_memory_history(enabled=None))
    return {"snapshot_file": str(path), "seconds": seconds}
