"""The built-in models this computer can serve, cheaply enough to list on every request.

Lists the EfficientNet-Lite models always (installed or not, with the reason when not)
and the torchvision classifiers whose weights file already sits in torchvision's
checkpoints folder. Nothing is loaded. A name that arrives over HTTP is only ever
compared with this table; the only path built is the checkpoints folder joined with a
file name torchvision itself gives for a known architecture.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from app.models import efficientnet_lite, torchvision_models
from app.models.types import ModelLoadError


@dataclass(frozen=True)
class CatalogueEntry:
    """One model the appliance knows; ``note`` says in plain words why it is not installed."""

    name: str
    family: str  # "efficientnet_lite", "torchvision" or "own"
    input_size: int  # the square crop the model takes, in pixels
    installed: bool
    note: str
    task: str = "classify"  # "classify", "multilabel" or "embed"
    format: str = ""  # an own model's format (timm, onnx, ...); a built-in's is its family
    labels: int = 1000  # how many labels it answers with (ImageNet's for the built-in ones)
    channels: int = 3  # colour channels of its input: 3 (RGB), 1 for a grey model


def _lite_entries() -> list[CatalogueEntry]:
    entries = []
    for name, variant in efficientnet_lite.MODELS.items():
        try:
            efficientnet_lite.weights_file(name)
        except ModelLoadError as exc:
            installed, note = False, str(exc)
        else:
            installed, note = True, ""
        entries.append(CatalogueEntry(name, efficientnet_lite.FAMILY, variant.crop,
                                      installed, note, format=efficientnet_lite.FAMILY))
    return entries


def _local_files() -> set[str]:
    """Names of the regular files in torchvision's checkpoints folder (one directory read)."""
    try:
        with os.scandir(torchvision_models.checkpoints_dir()) as found:
            return {entry.name for entry in found if entry.is_file()}
    except OSError:  # no folder yet, or not readable: no torchvision weights to offer
        return set()


def _torchvision_entries() -> list[CatalogueEntry]:
    present = _local_files()
    if not present:  # nothing downloaded: no need to ask torchvision (slow to import)
        return []
    return [CatalogueEntry(name, torchvision_models.FAMILY, input_size, True, "",
                           format=torchvision_models.FAMILY)
            for name, (filename, input_size) in torchvision_models.expected_files().items()
            if filename in present]


def builtin_catalogue() -> list[CatalogueEntry]:
    """The Lite models (always), then every torchvision classifier with local weights;
    own models join them in ``app.models.sources``."""
    return [*_lite_entries(), *_torchvision_entries()]
