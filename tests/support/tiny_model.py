"""A real torch classifier small enough to load and warm up in a moment on the CPU, for
engine tests that are about the engine, not about EfficientNet."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from app.models import LoadedModel
from app.preprocessing import Preprocessing


def tiny_model() -> LoadedModel:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                           nn.Linear(4, 10)).eval()
    return LoadedModel("tiny", module, [f"class {i}" for i in range(10)],
                       Preprocessing(resize=20, crop=16, mean=(0, 0, 0), std=(1, 1, 1)),
                       Path("tiny.pth"), "tiny-1", torch.device("cpu"))
