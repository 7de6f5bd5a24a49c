"""``GET /v1/models``: the loaded model and what warmup measured about it."""

from __future__ import annotations

from fastapi import APIRouter, Request

from app.schemas import BatchTimingOut, ModelOut, ModelsResponse
from app.state import state_of

router = APIRouter()


@router.get("/v1/models", response_model=ModelsResponse, summary="The loaded model")
async def models(request: Request) -> ModelsResponse:
    engine = state_of(request).engine
    runtime = engine.runtime
    if runtime is None:
        return ModelsResponse(models=[])
    loaded, warmup = runtime.model, runtime.warmup
    return ModelsResponse(models=[ModelOut(
        name=loaded.name,
        device=str(loaded.device),
        weights_file=str(loaded.weights_file),
        weights_version=loaded.weights_version,
        weights_bytes=runtime.memory.weights_bytes,
        input_size=loaded.preprocessing.crop,
        max_batch_size=engine.batcher.max_batch,
        warmup_seconds=round(warmup.duration_s, 3),
        warmup=[BatchTimingOut(batch_size=t.batch_size, latency_ms=round(t.seconds * 1000, 2),
                               images_per_second=round(t.images_per_second, 2))
                for t in warmup.timings],
    )])
