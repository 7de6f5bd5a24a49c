"""``GET /v1/models``: the catalogue, what is loaded and what was measured about it; the
admin's ``POST /v1/models/{name}/load`` and ``/unload``.

A model name from HTTP is only ever looked up in the catalogue (``engine.knows``):
no path is ever built from it.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request

from app.engine.view import ModelFigures
from app.errors import NotFound
from app.gates.admin_token import require_admin
from app.http.state import state_of
from app.models import CatalogueEntry
from app.schemas import BatchFitOut, BatchTimingOut, ErrorResponse, ModelOut, ModelsResponse

router = APIRouter()
admin = APIRouter(dependencies=[Depends(require_admin)],
                  responses={code: {"model": ErrorResponse} for code in (401, 404, 409, 503)})
ModelName = Annotated[str, Path(max_length=64, description="A name GET /v1/models lists.")]


def _loaded(model: ModelFigures) -> dict[str, object]:
    """What is known about a loaded model, by ModelOut's field names."""
    fit = model.batch_fit
    return {
        "state": "loaded", "pinned": model.pinned, "keep_alive_s": model.keep_alive_s,
        "expires_in_s": model.expires_in_s, "device": model.device,
        "weights_file": model.weights_file, "weights_version": model.weights_version,
        "weights_bytes": model.weights_bytes, "fixed_bytes": model.fixed_bytes,
        "bytes_per_sample": model.bytes_per_sample, "batch_size": model.max_batch,
        "max_batch_size": model.max_batch,
        "images_per_second": round(model.images_per_second, 2),
        "batch_fit": None if fit is None else BatchFitOut(
            a_ms=round(fit.a_s * 1000, 3), b_ms=round(fit.b_s * 1000, 3),
            observations=fit.observations),
        "profile_reused": model.profile_reused,
        "profile_complete": model.profile_complete,
        "warmup_seconds": round(model.warmup_seconds, 3),
        "warmup": [BatchTimingOut(batch_size=t.batch_size,
                                  latency_ms=round(t.seconds * 1000, 2),
                                  images_per_second=round(t.images_per_second, 2))
                   for t in model.warmup],
    }


@router.get("/v1/models", response_model=ModelsResponse,
            summary="The models this vramguard can serve, loaded or not")
async def models(request: Request) -> ModelsResponse:
    engine = state_of(request).engine
    view = engine.view()
    entries = {e.name: e for e in engine.sources.catalogue(fresh=True)}
    for name, loaded in view.models.items():  # a --model outside the catalogue (own weights)
        entries.setdefault(name, CatalogueEntry(name, "torchvision", loaded.crop, True, ""))
    out = []
    for name, entry in entries.items():
        figures = view.models.get(name)
        fields = _loaded(figures) if figures is not None else {
            "state": "loading" if name in view.loading else "available"}
        out.append(ModelOut(name=name, family=entry.family, input_size=entry.input_size,
                            installed=entry.installed, note=entry.note, task=entry.task,
                            format=entry.format or entry.family, labels=entry.labels,
                            **fields))
    return ModelsResponse(models=out)


@admin.post("/v1/models/{name}/load", response_model=ModelOut,
            responses={code: {"model": ErrorResponse} for code in (403, 422)},
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
