"""Any torchvision classification architecture, with weights from a local file.

vramguard never downloads: the file comes from `--weights` or torchvision's own
cache folder, where a previous `torchvision.models.get_model(..., weights=...)`
on a connected machine would have put it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from app.models import efficientnet_lite
from app.models.types import ModelLoadError
from app.preprocessing import Preprocessing

FAMILY = "torchvision"


def _models() -> Any:
    """``torchvision.models``, imported on first use: it takes over a second, and a start
    that serves only EfficientNet-Lite models never needs it."""
    import torchvision.models

    return torchvision.models


@cache
def _names() -> tuple[str, ...]:
    return tuple(sorted(_models().list_models(module=_models())))


def names() -> list[str]:
    """The classification architectures this torchvision provides."""
    return list(_names())


def _weights_enum(name: str) -> Any:
    if name not in _names():
        raise ModelLoadError(f"Unknown model '{name}'. Use "
                             f"{', '.join(efficientnet_lite.MODELS)} or one of: "
                             f"{', '.join(_names())}.")
    return _models().get_model_weights(name).DEFAULT


@cache
def expected_files() -> Mapping[str, tuple[str, int]]:
    """Architecture name -> (its default weights' file name in the checkpoints folder, its
    input size). Cached: the catalogue asks on every request, and the answer only changes
    with torchvision itself."""
    found = {}
    for name in _names():
        enum = _weights_enum(name)
        found[name] = (os.path.basename(str(enum.url)), int(enum.transforms().crop_size[0]))
    return MappingProxyType(found)


def checkpoints_dir() -> Path:
    """Where torchvision keeps downloaded weights (``torch.hub.get_dir()``/checkpoints)."""
    return Path(torch.hub.get_dir()) / "checkpoints"


def weights_file(name: str, weights: Path | None) -> Path:
    """The local weights file for ``name``; a clear error says where to put it."""
    enum = _weights_enum(name)
    if weights is not None:
        if not weights.is_file():
            raise ModelLoadError(f"The weights file {weights} does not exist.")
        return weights
    cached = checkpoints_dir() / expected_files()[name][0]
    if cached.is_file():
        return cached
    raise ModelLoadError(
        f"No weights for '{name}' on this computer. Download {enum.url} and either "
        f"save it as {cached} or start vramguard with --model {name} --weights "
        "PATH_TO_FILE.")


def build(name: str, state: dict[str, Any]) -> tuple[nn.Module, Preprocessing]:
    """Build ``name`` without weights, then load ``state`` strictly."""
    enum = _weights_enum(name)
    module: nn.Module = _models().get_model(name, weights=None)
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"The weights file does not fit model '{name}': "
                             f"{str(exc).splitlines()[0]}") from None
    transform = enum.transforms()
    crop = transform.crop_size[0]
    resize = transform.resize_size[0]
    preprocessing = Preprocessing(
        resize=resize,
        crop=crop,
        mean=tuple(255.0 * m for m in transform.mean),
        std=tuple(255.0 * s for s in transform.std),
    )
    return module, preprocessing
