"""Response bodies of the v1 API (they also document it in /docs)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class PredictionOut(BaseModel):
    label: str
    index: int
    score: float = Field(description="Probability between 0 and 1.")


class ClassifyResponse(BaseModel):
    model: str
    predictions: list[PredictionOut]
    batch_size: int = Field(description="Images computed together with this one "
                                        "(0 for a cached answer).")
    cached: bool
    timing_ms: dict[str, float]


class BatchTimingOut(BaseModel):
    batch_size: int
    latency_ms: float
    images_per_second: float


class ModelOut(BaseModel):
    name: str
    device: str
    weights_file: str
    weights_version: str
    weights_bytes: int
    input_size: int
    max_batch_size: int = Field(description="Batch size chosen at warmup.")
    warmup_seconds: float
    warmup: list[BatchTimingOut]


class ModelsResponse(BaseModel):
    models: list[ModelOut]


class ErrorBody(BaseModel):
    code: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody


class StatsResponse(BaseModel):
    uptime_s: float
    phase: str
    paused: bool
    queue_depth: int
    in_flight: int
    batches: int
    batched_images: int
    mean_batch_size: float
    largest_batch: int
    expired_in_queue: int
    withdrawn_in_queue: int
    requests: dict[str, int] = Field(description="Answered requests by outcome code.")
    rate_limited: int = Field(description="Requests refused with 429 since start.")
    cache_entries: int | None
