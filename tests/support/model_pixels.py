"""A test photo through the server's preprocessing, and a model's probabilities for it."""

from __future__ import annotations

import torch
from images import photo

from app.imaging.decoding import open_image
from app.imaging.pixels import model_input
from app.models import LoadedModel
from app.preprocessing import Preprocessing

CPU = torch.device("cpu")
MAX_PIXELS = 40_000_000  # the default max_image_pixels


def model_pixels(spec: Preprocessing, name: str = "coffee.jpg") -> torch.Tensor:
    """A test photo as the server makes it (decode worker's crop, then normalised)."""
    return torch.from_numpy(model_input(open_image(photo(name), MAX_PIXELS, spec.resize), spec))


def probabilities(model: LoadedModel, spec: Preprocessing | None = None,
                  name: str = "coffee.jpg") -> torch.Tensor:
    """Class probabilities for one test photo, with the model's preprocessing unless told."""
    with torch.inference_mode():
        pixels = model_pixels(spec or model.preprocessing, name)
        return model.module(pixels[None]).softmax(-1)[0]
