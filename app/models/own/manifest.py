"""What a model folder says it is: ``vramguard.toml``, validated by one pydantic model.

Every error names the file and the field (``vramguard.toml: [preprocessing] mean: …``),
so a person can fix the folder without reading code. Mean and std are in 0-1 units, as
timm and Hugging Face write them; ``Preprocessing`` turns them into pixel units.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from app.preprocessing import Preprocessing

MANIFEST = "vramguard.toml"
TASKS = ("classify", "multilabel", "embed")
FORMATS = ("timm", "torchvision", "torchscript", "export", "onnx")  # a manifest's
HF_FORMATS = ("timm-hf", "transformers")  # a Hugging Face folder, read without a manifest
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "lanczos", "box", "hamming")
DEFAULT_CROP_SHARE = 0.875  # the ImageNet habit: resize to size / 0.875, crop the centre


class FolderError(Exception):
    """A model folder vramguard will not serve; the message says which file and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Strict):
    """How to build the model: a format and the file in the folder that holds it."""

    format: Literal["timm", "torchvision", "torchscript", "export", "onnx"]
    file: str = Field(min_length=1)
    architecture: str | None = Field(None, min_length=1)
    num_classes: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _architecture_where_needed(self) -> ModelSection:
        if self.format in ("timm", "torchvision") and not self.architecture:
            raise ValueError(f"format '{self.format}' needs an architecture name")
        if self.format not in ("timm", "torchvision") and self.architecture:
            raise ValueError(f"format '{self.format}' takes no architecture: the file "
                             "holds the whole model")
        if self.num_classes is not None and self.format != "timm":
            raise ValueError("num_classes is only for the timm format")
        return self


class PreprocessingSection(_Strict):
    """How an image becomes the model's input: resize the short side, crop the centre."""

    size: int = Field(224, ge=8, le=1024)
    resize: int | None = Field(None, ge=8, le=2048)
    interpolation: Literal["nearest", "bilinear", "bicubic", "lanczos", "box",
                           "hamming"] = "bilinear"
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    colour: Literal["rgb", "grey"] = "rgb"

    @model_validator(mode="after")
    def _sane(self) -> PreprocessingSection:
        if self.resize is not None and self.resize < self.size:
            raise ValueError(f"resize ({self.resize}) must be at least size ({self.size})")
        if any(s <= 0 for s in self.std):
            raise ValueError("every std value must be above 0")
        if any(not -10 <= m <= 10 for m in self.mean):
            raise ValueError("mean values are in 0-1 units (0.485, not 123.7)")
        return self

    def spec(self) -> Preprocessing:
        return preprocessing(self.size, self.resize, self.interpolation, self.mean,
                             self.std, grey=self.colour == "grey")


def preprocessing(size: int, resize: int | None, interpolation: str,
                  mean: tuple[float, ...], std: tuple[float, ...], *, grey: bool = False
                  ) -> Preprocessing:
    """``Preprocessing`` from 0-1 mean and std (grey: their average), resize defaulting to
    ``size / 0.875``."""
    if grey:
        mean, std = (sum(mean) / len(mean),), (sum(std) / len(std),)
    return Preprocessing(resize=resize or round(size / DEFAULT_CROP_SHARE), crop=size,
                         mean=tuple(255.0 * m for m in mean),
                         std=tuple(255.0 * s for s in std),
                         interpolation=interpolation, channels=1 if grey else 3)


class Manifest(_Strict):
    """The whole ``vramguard.toml``."""

    task: Literal["classify", "multilabel", "embed"] = "classify"
    labels: str | None = Field(None, min_length=1)
    threshold: float | None = Field(None, gt=0, lt=1)
    description: str = Field("", max_length=500)
    model: ModelSection
    preprocessing: PreprocessingSection = PreprocessingSection()

    @model_validator(mode="after")
    def _task_fields(self) -> Manifest:
        if self.task in ("classify", "multilabel") and not self.labels:
            raise ValueError(f"task '{self.task}' needs labels (a text file, one per line)")
        if self.task == "embed" and self.labels:
            raise ValueError("task 'embed' takes no labels: it answers with features")
        if self.threshold is not None and self.task != "multilabel":
            raise ValueError("threshold is only for task 'multilabel'")
        return self

    @property
    def score_threshold(self) -> float:
        return self.threshold if self.threshold is not None else 0.5


def describe(error: ValidationError, source: str) -> str:
    """A pydantic error as one line per problem, each naming the file and the field."""
    lines = []
    for item in error.errors():
        where = [str(part) for part in item["loc"]]
        field = (f"[{where[0]}] {'.'.join(where[1:])}" if len(where) > 1
                 else (where[0] if where else ""))
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "is not a field vramguard knows (check its spelling)"
        lines.append(f"{source}: {field}: {message}" if field else f"{source}: {message}")
    return "; ".join(lines)


def parse_manifest(text: str, source: str = MANIFEST) -> Manifest:
    """``text`` as a manifest, or FolderError naming ``source`` and each bad field."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise FolderError(f"{source} is not valid TOML: {exc}") from None
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise FolderError(describe(exc, source)) from None


def manifest_from(data: dict[str, object], source: str) -> Manifest:
    """A manifest from fields found elsewhere (a Hugging Face config), errors naming it."""
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise FolderError(describe(exc, source)) from None


def read_manifest(folder: Path) -> Manifest | None:
    """The folder's ``vramguard.toml``, None when it has none."""
    path = folder / MANIFEST
    if not path.exists():
        return None
    return parse_manifest(path.read_text(encoding="utf-8", errors="replace"))
