"""``/v1/memory``: the readings anyone local may see, and the admin actions on memory."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated, Any

import platformdirs
import torch
from fastapi import APIRouter, Depends, Query, Request

from app.config import APP_NAME
from app.engine.engine import InferenceEngine
from app.errors import Conflict
from app.gates.admin_token import require_admin
from app.http.state import state_of
from app.memory.history import ROUTE
from app.schemas import ErrorResponse, MemoryReport

router = APIRouter()
admin = APIRouter(dependencies=[Depends(require_admin)],
                  responses={401: {"model": ErrorResponse}, 409: {"model": ErrorResponse},
                             503: {"model": ErrorResponse}})


# Python stacks only: "all" (C++ frames too) is refused on Windows and symbolises on the
# device thread, stalling every batch. The newest allocations and frees are kept: enough
# for many batches' pattern, while the snapshot stays small enough for the visualiser.


def _dump_snapshot(path: Path) -> None:
    """Write the recorded allocator history to ``path`` (on the device thread)."""
    torch.cuda.memory._dump_snapshot(str(path))  # type: ignore[no-untyped-call]  # no hints in torch


def _engine(request: Request) -> InferenceEngine:
    """The engine, once it is ready to act on (503 before)."""
    engine = state_of(request).engine
    engine.require_runtime()
    return engine


@router.get("/v1/memory", response_model=MemoryReport,
            responses={503: {"model": ErrorResponse}},
            summary="Device memory, budget, watermarks and guard state")
async def memory(request: Request) -> MemoryReport:
    engine = _engine(request)
    return await engine.on_device(engine.memory_report)


@admin.post("/v1/memory/empty-cache", summary="Give cached memory back (admin)")
async def empty_cache(request: Request) -> dict[str, int]:
    engine = _engine(request)
    before, after = await engine.on_device(engine.release)
    engine.require_runtime().guard.counters.cache_empties += 1
    return {"reserved_before_bytes": before, "reserved_after_bytes": after,
            "freed_bytes": max(0, before - after)}


@admin.post("/v1/memory/reset-peak", summary="Start measuring peaks afresh (admin)")
async def reset_peak(request: Request) -> dict[str, int]:
    engine = _engine(request)
    before, after = await engine.on_device(engine.reset_peak)
    return {"peak_allocated_before_bytes": before, "peak_allocated_after_bytes": after}


@admin.post("/v1/memory/record-history", responses={403: {"model": ErrorResponse}},
           summary="Record allocator history (admin, GPU only)")
async def record_history(request: Request,
                         seconds: Annotated[float, Query(gt=0, le=300)] = 10) -> dict[str, Any]:
    """Record CUDA allocations (the newest 50,000, with Python stacks) for ``seconds`` and
    write a snapshot file that PyTorch's memory visualizer (pytorch.org/memory_viz) opens."""
    engine = _engine(request)
    if engine.device.type != "cuda":
        raise Conflict("Allocator history exists only on an NVIDIA GPU; this appliance "
                       "runs on the CPU.")
    folder = Path(platformdirs.user_data_dir(APP_NAME, appauthor=False)) / "memory-snapshots"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / time.strftime("snapshot-%Y%m%d-%H%M%S.pickle")
    history = engine.upkeep.history  # the leak tracer's recording, if on, goes on after
    await engine.on_device(lambda: history.want(ROUTE, True))
    try:
        await asyncio.sleep(seconds)
        await engine.on_device(lambda: _dump_snapshot(path))
    finally:
        await engine.on_device(lambda: history.want(ROUTE, False))
    return {"snapshot_file": str(path), "seconds": seconds}


router.include_router(admin)
