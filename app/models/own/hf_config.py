"""A Hugging Face folder as published and downloaded, read without a manifest.

Two kinds: a timm model as ``timm.models.save_for_hf`` writes it (``config.json`` with
``architecture``, ``label_names`` and a ``pretrained_cfg`` holding the input size,
crop share, interpolation, mean and std), and a transformers image classifier as
``save_pretrained`` writes it (``config.json`` with ``architectures`` and ``id2label``,
``preprocessor_config.json`` with the image processor's sizes). Only
``model.safetensors`` is read; a folder with only the pickled ``pytorch_model.bin`` is
refused with the conversion.

transformers resizes some models (ViT) to an exact size, stretching a photo that is not
square; vramguard always resizes the short side and crops the centre, so the answers for
such photos may differ a little from transformers' pipeline (square ones are the same).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.models.own.folder_files import SAFE_CONVERSION, inside
from app.models.own.manifest import (
    DEFAULT_CROP_SHARE,
    INTERPOLATIONS,
    FolderError,
    preprocessing,
)

if TYPE_CHECKING:
    from app.models.own.description import ModelDescription

CONFIG = "config.json"
PROCESSOR = "preprocessor_config.json"
WEIGHTS = "model.safetensors"
PICKLED_WEIGHTS = "pytorch_model.bin"
MAX_CONFIG_BYTES = 8 * 2**20
PIL_FILTERS = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box",
               5: "hamming"}  # PIL.Image.Resampling, as image processors store it
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _json(folder: Path, name: str) -> dict[str, Any]:
    path = inside(folder, name)
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise FolderError(f"{name} is too large for a configuration file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise FolderError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise FolderError(f"{name} is not a JSON object")
    return data


def _weights(folder: Path) -> str:
    if (folder / WEIGHTS).exists():
        return WEIGHTS
    if (folder / PICKLED_WEIGHTS).exists():
        raise FolderError(f"The folder has only {PICKLED_WEIGHTS}, a pickle; vramguard "
                          f"never unpickles weights. Convert it: {SAFE_CONVERSION}")
    raise FolderError(f"The folder has {CONFIG} but no {WEIGHTS}")


def describe(folder: Path) -> ModelDescription:
    """A timm or transformers folder's model; FolderError naming the file otherwise."""
    config = _json(folder, CONFIG)
    if "architecture" in config:
        return _timm(folder, config)
    if "architectures" in config or "model_type" in config:
        return _transformers(folder, config)
    raise FolderError(f"{CONFIG} is neither timm's nor transformers': it names no "
                      "architecture")


def _labels(names: object, count: int, source: str) -> tuple[str, ...]:
    """Labels from a list, or a dict of index to name; numbered when there are none."""
    if names is None or names == {} or names == []:
        return tuple(f"class {i}" for i in range(count))
    if isinstance(names, dict):
        try:
            indexed = {int(key): str(value) for key, value in names.items()}
        except (TypeError, ValueError):
            raise FolderError(f"{source}: the label indices are not numbers") from None
        if sorted(indexed) != list(range(len(indexed))):
            raise FolderError(f"{source}: the labels are not numbered 0 to "
                              f"{len(indexed) - 1}")
        return tuple(indexed[i] for i in range(len(indexed)))
    if isinstance(names, list):
        return tuple(str(name) for name in names)
    raise FolderError(f"{source}: the labels are neither a list nor a table")


def _square(size: object, field: str, source: str) -> int:
    if isinstance(size, int) and size > 0:
        return size
    if isinstance(size, dict):
        height, width = size.get("height"), size.get("width")
        if isinstance(height, int) and height == width and height > 0:
            return height
        if "height" in size:
            raise FolderError(f"{source}: {field} is {height}x{width}; vramguard serves "
                              "square inputs only")
        edge = size.get("shortest_edge")
        if isinstance(edge, int) and edge > 0:
            return edge
    raise FolderError(f"{source}: {field} is not a size vramguard understands: {size!r}")


def _pair(values: object, field: str, source: str, default: tuple[float, ...]
          ) -> tuple[float, float, float]:
    values = default if values is None else values
    if isinstance(values, (int, float)):
        values = (values,) * 3
    if (not isinstance(values, (list, tuple)) or len(values) not in (1, 3)
            or not all(isinstance(v, (int, float)) for v in values)):
        raise FolderError(f"{source}: {field} must be three numbers")
    triple = tuple(float(v) for v in values) * (3 if len(values) == 1 else 1)
    return triple[0], triple[1], triple[2]


def _timm(folder: Path, config: dict[str, Any]) -> ModelDescription:
    from app.models.own.description import ModelDescription

    source = CONFIG
    pretrained = config.get("pretrained_cfg", config)
    if not isinstance(pretrained, dict):
        raise FolderError(f"{source}: pretrained_cfg is not a table")
    input_size = pretrained.get("input_size", (3, 224, 224))
    if (not isinstance(input_size, list | tuple) or len(input_size) != 3
            or input_size[1] != input_size[2] or input_size[0] not in (1, 3)):
        raise FolderError(f"{source}: input_size {input_size} is not a square RGB or grey "
                          "input")
    channels, size = int(input_size[0]), int(input_size[1])
    crop_share = pretrained.get("crop_pct", DEFAULT_CROP_SHARE)
    if not isinstance(crop_share, (int, float)) or not 0.1 <= crop_share <= 1:
        raise FolderError(f"{source}: crop_pct must be between 0.1 and 1")
    interpolation = pretrained.get("interpolation", "bilinear")
    if interpolation not in INTERPOLATIONS:
        raise FolderError(f"{source}: interpolation '{interpolation}' is not one of "
                          f"{', '.join(INTERPOLATIONS)}")
    count = config.get("num_classes", pretrained.get("num_classes", 1000))
    if not isinstance(count, int) or count < 0:
        raise FolderError(f"{source}: num_classes must be a whole number")
    names = config.get("label_names", pretrained.get("label_names"))
    model_args = config.get("model_args", {})
    if not isinstance(model_args, dict):
        raise FolderError(f"{source}: model_args is not a table")
    return ModelDescription(
        task="classify" if count else "embed",
        labels=_labels(names, count, source) if count else (),
        threshold=0.5, format="timm-hf", file=_weights(folder),
        preprocessing=preprocessing(size, round(size / crop_share), interpolation,
                                    _pair(pretrained.get("mean"), "mean", source,
                                          IMAGENET_MEAN),
                                    _pair(pretrained.get("std"), "std", source,
                                          IMAGENET_STD), grey=channels == 1),
        source=source, architecture=str(config["architecture"]), num_classes=count,
        model_args=model_args)


def _transformers(folder: Path, config: dict[str, Any]) -> ModelDescription:
    from app.models.own.description import ModelDescription

    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForImageClassification") for a in architectures):
        raise FolderError(f"{CONFIG}: {', '.join(map(str, architectures)) or 'the model'} "
                          "is not a transformers image classifier "
                          "(…ForImageClassification)")
    names = config.get("id2label")
    labels = _labels(names, len(names) if isinstance(names, dict) else 0, CONFIG)
    if not labels:
        raise FolderError(f"{CONFIG}: id2label lists no labels")
    processor = _json(folder, PROCESSOR) if (folder / PROCESSOR).exists() else {}
    size = _square(processor.get("size", 224), "size", PROCESSOR)
    crop, resize = size, size
    if processor.get("do_center_crop") and processor.get("crop_size") is not None:
        crop = _square(processor["crop_size"], "crop_size", PROCESSOR)
    elif isinstance(processor.get("crop_pct"), (int, float)) and processor["crop_pct"] > 0:
        resize = round(size / float(processor["crop_pct"]))
    if crop > resize:
        raise FolderError(f"{PROCESSOR}: the crop ({crop}) is larger than the resize "
                          f"({resize})")
    interpolation = PIL_FILTERS.get(processor.get("resample", 2))
    if interpolation is None:
        raise FolderError(f"{PROCESSOR}: resample {processor.get('resample')} is not one of "
                          "PIL's filters 0-5")
    channels = config.get("num_channels", 3)
    multilabel = config.get("problem_type") == "multi_label_classification"
    return ModelDescription(
        task="multilabel" if multilabel else "classify", labels=labels, threshold=0.5,
        format="transformers", file=_weights(folder),
        preprocessing=preprocessing(crop, resize, interpolation,
                                    _pair(processor.get("image_mean"), "image_mean",
                                          PROCESSOR, IMAGENET_MEAN),
                                    _pair(processor.get("image_std"), "image_std",
                                          PROCESSOR, IMAGENET_STD), grey=channels == 1),
        source=CONFIG)
