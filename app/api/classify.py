"""``POST /v1/classify``: the image's most likely classes (see ``image_flow``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from app.api.image_flow import BODY_DOC, KeepAlive, ModelQuery, Served, TopK, serve_image
from app.engine.predictor import CLASSIFY
from app.schemas import ClassifyResponse, ErrorResponse, PredictionOut

router = APIRouter()
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 404, 408, 413, 415, 422, 503)
}


@router.post("/v1/classify", response_model=ClassifyResponse, responses=ERRORS,
             openapi_extra=BODY_DOC, summary="Classify one image")
async def classify(
    request: Request,
    top_k: TopK = 5,
    model: ModelQuery = None,
    keep_alive: KeepAlive = None,
) -> ClassifyResponse:
    return classification(await serve_image(request, model, keep_alive, CLASSIFY, top_k),
                          top_k)


def classification(served: Served, top_k: int) -> ClassifyResponse:
    """The answer for one served image's ranking (also each line of the image stream)."""
    assert served.ranked is not None
    top = served.ranked.top(top_k)
    labels = served.model.labels
    return ClassifyResponse(
        model=served.model.name,
        predictions=[PredictionOut(label=labels[int(i)], index=int(i), score=float(s))
                     for i, s in zip(top.indices, top.scores, strict=True)],
        batch_size=served.batch_size,
        cached=served.batch_size is None,
        timing_ms=served.timing_ms(),
    )
