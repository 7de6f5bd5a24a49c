"""The forward pass: stack, run the model, softmax and top-k on the device.

Only the small ranked result is copied back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from app.models import LoadedModel


@dataclass(frozen=True)
class Sample:
    """One preprocessed image and how many classes its client wants back."""

    pixels: torch.Tensor
    top_k: int


@dataclass(frozen=True)
class Ranked:
    """Class indices and probabilities, best first."""

    indices: np.ndarray
    scores: np.ndarray

    def top(self, k: int) -> Ranked:
        return Ranked(self.indices[:k], self.scores[:k])


@dataclass(frozen=True)
class Prediction:
    """A ranking plus the size of the batch it was computed in."""

    ranked: Ranked
    batch_size: int


class Predictor:
    """Callable the batcher runs on the device thread.

    With ``keep_all`` (the result cache is on) every class is ranked so that a
    cached answer can serve any later ``top_k``; otherwise only the largest
    ``top_k`` of the batch leaves the device.
    """

    def __init__(self, model: LoadedModel, keep_all: bool) -> None:
        self.model = model
        self.keep_all = keep_all

    def __call__(self, samples: list[Sample]) -> list[Prediction]:
        classes = self.model.num_classes
        k = classes if self.keep_all else min(classes, max(s.top_k for s in samples))
        batch = torch.stack([s.pixels for s in samples]).to(self.model.device)
        with torch.inference_mode():
            probs = self.model.module(batch).float().softmax(dim=-1)
            scores, indices = probs.topk(k, dim=-1)
            scores, indices = scores.cpu().numpy(), indices.cpu().numpy()
        size = len(samples)
        return [Prediction(Ranked(indices[i], scores[i]), size) for i in range(size)]

    def random_batch(self, size: int) -> list[Sample]:
        """Inputs of the real shape for warmup; their content does not matter."""
        crop = self.model.preprocessing.crop
        return [Sample(torch.randn(3, crop, crop), 1) for _ in range(size)]
