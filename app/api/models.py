"""``GET /v1/models``: the catalogue, what is loaded and what was measured about it; the
admin's ``POST /v1/models/{name}/load`` and ``/unload``.

A model name from HTTP is only ever looked up in the catalogue (``engine.knows``):
no path is ever built from it.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request

from app.engine.engine import InferenceEngine, Runtime
from app.errors import NotFound
from app.gates.admin_token import require_admin
from app.http.state import state_of
from app.models import CatalogueEntry, catalogue
from app.schemas import BatchFitOut, BatchTimingOut, ErrorResponse, ModelOut, ModelsResponse

router = APIRouter()
admin = APIRouter(dependencies=[Depends(require_admin)],
                  responses={code: {"model": ErrorResponse} for code in (401, 404, 409, 503)})
ModelName = Annotated[str, Path(max_length=64, description="A name GET /v1/models lists.")]


def _loaded(engine: InferenceEngine, name: str, runtime: Runtime) -> dict[str, object]:
    """What is known about a loaded model, by ModelOut's field names."""
    loaded, warmup, guard = runtime.model, runtime.warmup, runtime.guard
    resident = engine.residents.get(name)
    size = guard.max_batch
    adaptive = runtime.batch_size
    line = adaptive.fit.line if adaptive is not None else None
    return {
        "state": "loaded", "pinned": bool(resident and resident.pinned),
        "keep_alive_s": None if resident is None else resident.keep_alive_s,
        "expires_in_s": None if resident is None else resident.expires_in(time.monotonic()),
        "device": str(loaded.device), "weights_file": str(loaded.weights_file),
        "weights_version": loaded.weights_version,
        "weights_bytes": runtime.memory.weights_bytes,
        "fixed_bytes": guard.fit.fixed_bytes, "bytes_per_sample": guard.fit.bytes_per_sample,
        "batch_size": size, "max_batch_size": size,
        "images_per_second": round(size / line.seconds(size), 2) if line is not None
        else round(warmup.throughput_at(size), 2),
        "batch_fit": None if adaptive is None or line is None else BatchFitOut(
            a_ms=round(line.a * 1000, 3), b_ms=round(line.b * 1000, 3),
            observations=adaptive.fit.observations),
        "profile_reused": runtime.reused_profile,
        "warmup_seconds": round(warmup.duration_s, 3),
        "warmup": [BatchTimingOut(batch_size=t.batch_size,
                                  latency_ms=round(t.seconds * 1000, 2),
                                  images_per_second=round(t.images_per_second, 2))
                   for t in warmup.timings],
    }


@router.get("/v1/models", response_model=ModelsResponse,
            summary="The models this vramguard can serve, loaded or not")
async def models(request: Request) -> ModelsResponse:
    engine = state_of(request).engine
    runtimes = dict(engine.runtimes)
    entries = {e.name: e for e in catalogue()}
    for name, runtime in runtimes.items():  # a --model outside the catalogue (own weights)
        entries.setdefault(name, CatalogueEntry(name, "torchvision",
                                                runtime.model.preprocessing.crop, True, ""))
    out = []
    for name, entry in entries.items():
        fields: dict[str, object] = {"state": "loading" if name in engine.loading
                                     else "available"}
        if name in runtimes:
            fields = _loaded(engine, name, runtimes[name])
        out.append(ModelOut(name=name, family=entry.family, input_size=entry.input_size,
                            installed=entry.installed, note=entry.note, **fields))
    return ModelsResponse(models=out)


@admin.post("/v1/models/{name}/load", response_model=ModelOut,
            summary="Load a model now and keep it until unloaded (admin)")
async def load(request: Request, name: ModelName) -> ModelOut:
    state = state_of(request)
    engine = state.engine
    await engine.acquire(name, state.settings.request_timeout_s * 6, keep_alive_s=-1.0)
    return _one(await models(request), name)


@admin.post("/v1/models/{name}/unload", summary="Unload a model now (admin)")
async def unload(request: Request, name: ModelName) -> dict[str, str]:
    await state_of(request).engine.unload(name)
    return {"unloaded": name}


def _one(listing: ModelsResponse, name: str) -> ModelOut:
    for model in listing.models:
        if model.name == name:
            return model
    raise NotFound(f"There is no model called '{name}'.")


router.include_router(admin)
