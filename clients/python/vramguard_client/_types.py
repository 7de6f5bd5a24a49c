"""Typed answers: frozen dataclasses built from vramguard's JSON."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from vramguard_client._errors import UnexpectedResponse, VramguardError

T = TypeVar("T")


@dataclass(frozen=True)
class Prediction:
    label: str
    index: int
    score: float  # probability between 0 and 1


@dataclass(frozen=True)
class Classification:
    """One image's answer. For a multilabel model (one that names every label that fits
    the picture, not one class) ``labels`` holds every label scored above ``threshold``,
    best first, and ``predictions`` the same; for any other model ``labels`` and
    ``threshold`` are None."""

    predictions: tuple[Prediction, ...]  # most likely first
    model: str
    batch_size: int | None  # images computed together with this one; None when cached
    cached: bool
    timing_ms: Mapping[str, float]
    labels: tuple[Prediction, ...] | None = None  # None: not a multilabel model
    threshold: float | None = None  # the score a label needed (multilabel only)

    @property
    def top(self) -> Prediction:
        """The most likely class (IndexError when no label of a multilabel model scored
        above the threshold)."""
        if not self.predictions:
            raise IndexError("this answer names no label: none scored above the "
                             f"threshold {self.threshold}")
        return self.predictions[0]


@dataclass(frozen=True)
class Embedding:
    vector: tuple[float, ...]  # L2-normalised features
    dimensions: int
    model: str
    cached: bool

    def similarity(self, other: Embedding) -> float:
        """Cosine similarity with ``other`` (1: the same picture)."""
        if self.dimensions != other.dimensions:
            raise ValueError(f"embeddings of {self.dimensions} and {other.dimensions} "
                             "dimensions cannot be compared")
        return math.fsum(a * b for a, b in zip(self.vector, other.vector, strict=True))


@dataclass(frozen=True)
class ModelInfo:
    name: str
    state: str  # loaded, loading or available
    family: str
    input_size: int
    installed: bool  # whether its weights are on this computer
    note: str  # why it cannot load, when it cannot
    pinned: bool  # loaded at start and never unloaded to make room
    keep_alive_s: float | None
    expires_in_s: float | None
    device: str | None
    weights_bytes: int | None
    batch_size: int | None
    images_per_second: float | None
    task: str = "classify"  # classify, multilabel or embed (features only: embed())
    format: str = ""  # where it comes from: efficientnet_lite, timm, onnx, ...
    labels: int = 1000  # how many labels it answers with (0: embed)

    @property
    def loaded(self) -> bool:
        return self.state == "loaded"


@dataclass(frozen=True)
class MemoryInfo:
    device: str
    state: str  # ok, high or shedding
    total_bytes: int
    used_bytes: int  # all programs
    free_bytes: int
    others_bytes: int  # what other programs hold
    allocated_bytes: int
    reserved_bytes: int
    weights_bytes: int
    budget_bytes: int
    usage_bytes: int  # what the watermarks are compared with
    low_watermark_bytes: int
    high_watermark_bytes: int
    max_batch_now: int  # images that fit in a batch right now
    oom_events: int
    oom_recoveries: int
    oom_failures: int
    leak_suspected: bool
    gpu_utilization_ratio: float | None  # None on the CPU or without NVML


@dataclass(frozen=True)
class CacheRelease:
    """What ``empty_cache`` gave back."""

    reserved_before_bytes: int
    reserved_after_bytes: int
    freed_bytes: int


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """One input of ``classify_many``: its position and the item itself, and either its
    ``result`` or its ``error`` (a failure of one image does not stop the others)."""

    index: int
    image: object
    result: T | None = None
    error: VramguardError | OSError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _checked(cls: type[T], body: object, **defaults: Any) -> T:
    """``cls`` from the JSON object's fields of the same names; ``defaults`` for fields an
    older server may not send."""
    if not isinstance(body, Mapping):
        raise UnexpectedResponse(f"expected a JSON object for {cls.__name__}, got {body!r:.200}")
    names = getattr(cls, "__dataclass_fields__", {})
    missing = [name for name in names if name not in body and name not in defaults]
    if missing:
        raise UnexpectedResponse(f"{cls.__name__} without {', '.join(missing)}")
    return cls(**{name: body.get(name, defaults.get(name)) for name in names})


def _predictions(items: Any) -> tuple[Prediction, ...]:
    return tuple(Prediction(str(p["label"]), int(p["index"]), float(p["score"]))
                 for p in items)


def classification(body: Mapping[str, Any]) -> Classification:
    try:
        size = body.get("batch_size")
        labels, threshold = body.get("labels"), body.get("threshold")
        return Classification(_predictions(body["predictions"]), str(body["model"]),
                              None if size is None or body["cached"] else int(size),
                              bool(body["cached"]), dict(body.get("timing_ms") or {}),
                              None if labels is None else _predictions(labels),
                              None if threshold is None else float(threshold))
    except (KeyError, TypeError, ValueError) as exc:
        raise UnexpectedResponse(f"not a classification: {exc!r}") from None


def embedding(body: Mapping[str, Any]) -> Embedding:
    try:
        vector = tuple(float(v) for v in body["embedding"])
        return Embedding(vector, int(body.get("dimensions", len(vector))), str(body["model"]),
                         bool(body["cached"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise UnexpectedResponse(f"not an embedding: {exc!r}") from None


def model_info(body: object) -> ModelInfo:
    return _checked(ModelInfo, body, note="", pinned=False, keep_alive_s=None,
                    expires_in_s=None, device=None, weights_bytes=None, batch_size=None,
                    images_per_second=None, task="classify", format="", labels=1000)


def model_list(body: Mapping[str, Any]) -> list[ModelInfo]:
    models = body.get("models")
    if not isinstance(models, list):
        raise UnexpectedResponse("not a model list")
    return [model_info(entry) for entry in models]


def memory_info(body: Mapping[str, Any]) -> MemoryInfo:
    return _checked(MemoryInfo, body, leak_suspected=False, gpu_utilization_ratio=None)


def cache_release(body: Mapping[str, Any]) -> CacheRelease:
    return _checked(CacheRelease, body)
