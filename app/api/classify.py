"""``POST /v1/classify``: the image's most likely classes (see ``image_flow``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from app.api.image_flow import (
    BODY_DOC,
    KeepAlive,
    ModelQuery,
    Served,
    Threshold,
    TopK,
    serve_image,
)
from app.api.keep_alive import HEADER_DOC
from app.engine.predictor import CLASSIFY, MULTILABEL
from app.schemas import ClassifyResponse, ErrorResponse, PredictionOut

router = APIRouter()
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 404, 408, 413, 415, 422, 503)
}


@router.post("/v1/classify", response_model=ClassifyResponse,
             responses={**ERRORS, 200: {"headers": HEADER_DOC}},
             openapi_extra=BODY_DOC, summary="Classify one image")
async def classify(
    request: Request,
    top_k: TopK = 5,
    model: ModelQuery = None,
    keep_alive: KeepAlive = None,
    threshold: Threshold = None,
) -> ClassifyResponse:
    return classification(await serve_image(request, model, keep_alive, CLASSIFY, top_k),
                          top_k, threshold)


def classification(served: Served, top_k: int, threshold: float | None = None
                   ) -> ClassifyResponse:
    """The answer for one served image's ranking (also each line of the image stream):
    the ``top_k`` best, or for a multilabel model every label above the threshold (the
    request's, else the model's own)."""
    assert served.ranked is not None
    model = served.model
    multilabel = model.task == MULTILABEL
    cut = (model.threshold if threshold is None else threshold) if multilabel else None
    ranked = served.ranked
    if cut is None:
        top = ranked.top(top_k)
        indices, scores = top.indices, top.scores
    else:
        keep = ranked.scores > cut
        indices, scores = ranked.indices[keep], ranked.scores[keep]
    found = [PredictionOut(label=model.labels[int(i)], index=int(i), score=float(s))
             for i, s in zip(indices, scores, strict=True)]
    return ClassifyResponse(
        model=model.name,
        predictions=found,
        labels=found if multilabel else None,
        threshold=cut,
        batch_size=served.batch_size,
        cached=served.batch_size is None,
        timing_ms=served.timing_ms(),
    )
