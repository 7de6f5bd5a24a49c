"""The Open Inference Protocol (KServe v2, Triton's HTTP API) under /v2, so that clients
written for Triton, KServe or Seldon (``tritonclient.http``) work unchanged.

Every image goes the way a ``/v1/classify`` image goes (``image_flow``): the model only
from the catalogue (``engine.acquire``), a place in line for each image (the first before
the body is read), the decode worker pool and the result cache for encoded files, the
batcher, the memory guard; the images of one request run concurrently, so they batch
together. The gates in front are the same, and their refusals, like every error here,
come in the protocol's shape ``{"error": "message"}`` (``app.gates.error_response``).

Decisions (docs/oip.md): a model is *ready* when an inference request would be served
now, loaded or loaded by that request from the catalogue; its metadata gives what the
catalogue knows until it is loaded (EMBEDDING's length is -1 then); without
``outputs`` a request gets PROBABILITIES only (EMBEDDING costs a feature tap).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse, Response

from app import __version__
from app.api.oip_codec import (
    BYTES,
    EMBEDDING,
    FP32,
    IMAGE,
    PIXELS,
    PROBABILITIES,
)
from app.api.oip_infer import VERSION, facts, require_serving, serve_inference
from app.engine.predictor import EMBED
from app.engine.runtime import still_loading, unknown_model
from app.errors import ApiError, BadRequest, NotFound
from app.gates import error_response
from app.http.state import AppState, state_of
from app.schemas_oip import (
    InferResponse,
    Live,
    ModelMetadata,
    ModelReady,
    OipError,
    Ready,
    ServerMetadata,
    TensorMetadata,
)

router = APIRouter(tags=["Open Inference Protocol (v2)"])
EXTENSIONS = ["classification", "binary_tensor_data"]
PLATFORM = "pytorch"
ModelName = Annotated[str, Path(max_length=64, description="A name GET /v1/models lists.")]
Version = Annotated[str, Path(max_length=16, description=f"Only {VERSION}.")]
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": OipError} for code in (400, 404, 408, 413, 415, 422, 503)
}
INFER_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {
                "type": "object", "required": ["inputs"],
                "properties": {
                    "id": {"type": "string"},
                    "parameters": {"type": "object"},
                    # exactly one: the images (IMAGE) or their pixels (PIXELS)
                    "inputs": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
                        "type": "object", "required": ["name", "datatype", "shape"],
                        "properties": {"name": {"type": "string", "enum": [IMAGE, PIXELS]},
                                       "datatype": {"type": "string", "enum": [BYTES, FP32]},
                                       "shape": {"type": "array",
                                                 "items": {"type": "integer"}},
                                       "parameters": {"type": "object"},
                                       "data": {"type": "array"}}}},
                    "outputs": {"type": "array", "items": {
                        "type": "object", "required": ["name"],
                        "properties": {"name": {"type": "string",
                                                "enum": [PROBABILITIES, EMBEDDING]},
                                       "parameters": {"type": "object"}}}},
                }}},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


@router.get("/v2/health/live", response_model=Live, summary="The server answers")
async def live() -> Live:
    return Live(live=True)


@router.get("/v2/health/ready", response_model=Ready, responses={503: {"model": OipError}},
            summary="The server takes inference requests")
async def ready(request: Request) -> Response:
    """503 while starting, after a failure or while paused; answered, not raised: polling
    readiness is not a request outcome to count."""
    try:
        require_serving(state_of(request).engine.view())
    except ApiError as exc:
        return error_response(exc, request.scope["path"])
    return JSONResponse(Ready(ready=True).model_dump())


@router.get("/v2", response_model=ServerMetadata, summary="Server metadata")
async def server_metadata() -> ServerMetadata:
    return ServerMetadata(name="vramguard", version=__version__, extensions=EXTENSIONS)


@router.get("/v2/models/{name}", response_model=ModelMetadata, responses=ERRORS,
            summary="Model metadata: its inputs and outputs")
async def model_metadata(request: Request, name: ModelName) -> ModelMetadata:
    return _metadata(state_of(request), name)


@router.get("/v2/models/{name}/versions/{version}", response_model=ModelMetadata,
            responses=ERRORS, summary="Model metadata, of a version")
async def version_metadata(request: Request, name: ModelName, version: Version
                           ) -> ModelMetadata:
    _check_version(name, version)
    return _metadata(state_of(request), name)


@router.get("/v2/models/{name}/ready", response_model=ModelReady, responses=ERRORS,
            summary="Whether an inference request for the model would be served now")
async def model_ready(request: Request, name: ModelName) -> Response:
    return _ready(request, name, VERSION)


@router.get("/v2/models/{name}/versions/{version}/ready", response_model=ModelReady,
            responses=ERRORS, summary="Whether a version of the model is ready")
async def version_ready(request: Request, name: ModelName, version: Version) -> Response:
    return _ready(request, name, version)


@router.post("/v2/models/{name}/infer", response_model=InferResponse, responses=ERRORS,
             openapi_extra=INFER_DOC, summary="Classify images (Open Inference Protocol)")
async def infer(request: Request, name: ModelName) -> Response:
    return await serve_inference(request, name)


@router.post("/v2/models/{name}/versions/{version}/infer", response_model=InferResponse,
             responses=ERRORS, openapi_extra=INFER_DOC, summary="Classify images, by version")
async def version_infer(request: Request, name: ModelName, version: Version) -> Response:
    _check_version(name, version)
    return await serve_inference(request, name)


def _check_version(name: str, version: str) -> None:
    if version != VERSION:
        raise NotFound(f"The model {name} has one version, {VERSION}; there is no version "
                       f"{version!r}.")


def _metadata(state: AppState, name: str) -> ModelMetadata:
    known = facts(state.engine, name)
    outputs = [] if known.task == EMBED else [
        TensorMetadata(name=PROBABILITIES, datatype=FP32, shape=[-1, known.classes])]
    if known.features:
        outputs.append(TensorMetadata(name=EMBEDDING, datatype=FP32,
                                      shape=[-1, known.features]))
    return ModelMetadata(
        name=name, versions=[VERSION], platform=PLATFORM,
        inputs=[TensorMetadata(name=IMAGE, datatype=BYTES, shape=[-1]),
                TensorMetadata(name=PIXELS, datatype=FP32,
                               shape=[-1, known.channels, known.crop, known.crop])],
        outputs=outputs)


def _ready(request: Request, name: str, version: str) -> Response:
    """200 when an inference request would be served now: loaded, or in the catalogue with
    its weights here (the request loads it); 503 while it is being loaded, as an inference
    request that waits past its deadline is told. Answered, not raised, like /readyz."""
    engine = state_of(request).engine
    try:
        _check_version(name, version)
        if not engine.knows(name):
            raise unknown_model(name)
        view = engine.view()
        require_serving(view)
        loaded = name in view.models
        if name in view.loading and not loaded:
            raise still_loading(name, engine.loader.times.seconds_left(name))
        if not loaded:
            entry = engine.sources.entry(name)
            if entry is None:
                view.loaded(name)
            elif not entry.installed:
                raise BadRequest(f"The model {name} cannot be loaded: {entry.note}")
    except ApiError as exc:
        return error_response(exc, request.scope["path"])
    return JSONResponse(ModelReady(name=name, ready=True, loaded=loaded).model_dump())
