"""``POST /v1/embed``: an image's features, for "find similar images" and duplicates.

The features are the model's penultimate layer (the input of its final classification
layer, 1280 numbers for EfficientNet-Lite0), L2-normalised, so the cosine similarity of
two images is the dot product of their vectors. They go through the same batcher,
memory guard and result cache as classification (cached apart from it).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from app.api.classify import ERRORS
from app.api.image_flow import BODY_DOC, KeepAlive, ModelQuery, serve_image
from app.api.keep_alive import HEADER_DOC
from app.engine.predictor import EMBED
from app.schemas import EmbedResponse

router = APIRouter()


@router.post("/v1/embed", response_model=EmbedResponse,
             responses={**ERRORS, 200: {"headers": HEADER_DOC}},
             openapi_extra=BODY_DOC, summary="Image features for similarity search")
async def embed(
    request: Request,
    model: ModelQuery = None,
    keep_alive: KeepAlive = None,
) -> EmbedResponse:
    served = await serve_image(request, model, keep_alive, EMBED, 1)
    vector = served.embedding
    assert vector is not None
    return EmbedResponse(model=served.model.name, dimensions=len(vector),
                         embedding=[round(float(v), 7) for v in vector],
                         batch_size=served.batch_size, cached=served.batch_size is None,
                         timing_ms=served.timing_ms())
