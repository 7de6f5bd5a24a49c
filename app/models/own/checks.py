"""The check every folder passes before it is served: one image through the whole path.

A picture is encoded, decoded and preprocessed the way an upload is, run through the
model alone and in a batch of two (vramguard batches), and the output must be what the
task needs: one score per label for ``classify`` and ``multilabel``, one flat feature
vector for ``embed``, finite, and the same for an image alone as in a batch.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch import nn

from app.imaging.decoding import open_image
from app.imaging.pixels import model_input
from app.models.own.description import ModelDescription
from app.models.own.manifest import FolderError
from app.preprocessing import Preprocessing

BATCH_TOLERANCE = 1e-3  # alone against in a batch: float32 kernels may differ this much


@dataclass(frozen=True)
class CheckResult:
    """What the check found: the model's output size per image."""

    outputs: int


def sample_pixels(spec: Preprocessing, seed: int) -> torch.Tensor:
    """A photo-like picture (gradients and noise) through the real decode path."""
    rng = np.random.default_rng(seed)
    side = max(spec.resize, spec.crop) + 17
    ramp = np.linspace(0, 255, side, dtype=np.float32)
    rgb = np.stack([np.add.outer(ramp, ramp) / 2, np.tile(ramp, (side, 1)),
                    rng.uniform(0, 255, (side, side))], axis=-1)
    buffer = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8), "RGB").save(buffer, format="PNG")
    opened = open_image(buffer.getvalue(), 64 * 2**20, spec.resize)
    return torch.from_numpy(model_input(opened, spec))


def _output(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        out = module(batch)
    if not isinstance(out, torch.Tensor):
        raise FolderError(f"The model answers a {type(out).__name__}, not one tensor; "
                          "export it with a single output")
    return out


def check_model(module: nn.Module, described: ModelDescription) -> CheckResult:
    """Raise FolderError unless ``module`` answers as ``described`` says it does."""
    spec = described.preprocessing
    first, second = sample_pixels(spec, 1), sample_pixels(spec, 2)
    try:
        alone = _output(module, first.unsqueeze(0))
        pair = _output(module, torch.stack([first, second]))
    except FolderError:
        raise
    except Exception as exc:
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise FolderError(f"The model failed on a {spec.crop}x{spec.crop} image with "
                          f"{spec.channels} colour channel(s), batched by 1 and 2: "
                          f"{message}") from None
    if alone.dim() != 2 or alone.shape[0] != 1 or pair.shape[0] != 2:
        raise FolderError(f"The model answers shape {tuple(alone.shape)} for one image; "
                          f"task '{described.task}' needs (1, N): one row per image")
    outputs = int(alone.shape[1])
    expected = described.outputs
    if expected is not None and outputs != expected:
        raise FolderError(f"The model answers {outputs} scores per image but the labels "
                          f"list {expected}: they must be the same")
    if outputs == 0:
        raise FolderError("The model answers nothing per image")
    if not bool(torch.isfinite(pair).all()):
        raise FolderError("The model answers values that are not numbers (NaN or "
                          "infinite) for an ordinary image")
    drift = float((pair[0] - alone[0]).abs().max())
    if drift > BATCH_TOLERANCE * max(1.0, float(alone.abs().max())):
        raise FolderError(f"The model answers differently for an image alone and in a "
                          f"batch (by {drift:.3g}); vramguard batches images, so it cannot "
                          "serve it (a model exported for batch size 1 only?)")
    return CheckResult(outputs)
