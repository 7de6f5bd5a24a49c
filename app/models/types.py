"""What the registry hands out, and how it says no."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from app.models.precision import FP32, Numerics
from app.preprocessing import Preprocessing


class ModelLoadError(Exception):
    """The model cannot be built or its weights cannot be found; says what to do."""


@dataclass
class LoadedModel:
    """A ready model: the module on its device plus everything needed to use it."""

    name: str
    module: nn.Module
    labels: list[str]
    preprocessing: Preprocessing
    weights_file: Path
    weights_version: str
    device: torch.device
    # Length of the penultimate features (``app.models.features``); 0 when the model has
    # no final linear layer to take them from (SqueezeNet classifies with a convolution).
    # A default, so stand-in models built without a registry need not know it.
    feature_dim: int = 0
    # What the model answers: "classify" (softmax over labels), "multilabel" (a sigmoid
    # per label, those above ``threshold``) or "embed" (its output is the features).
    task: str = "classify"
    threshold: float = 0.5
    # Where it came from: "efficientnet_lite", "torchvision" or an own model's format.
    family: str = "built-in"
    # One of the user's own, from the models folder (its family alone cannot say: an own
    # model may be a torchvision one).
    own: bool = False
    # The precision and layout it runs in (app.models.precision), set once it is loaded.
    numerics: Numerics = FP32

    @property
    def num_classes(self) -> int:
        return len(self.labels)
