"""How a model wants its pixels. A basic type: the models declare it, the decode workers
(which import neither torch nor numpy) and the pixel code follow it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preprocessing:
    """How a model wants its input: resize the short side, centre-crop, normalise.

    ``mean`` and ``std`` are in 0-255 pixel units, per RGB channel.
    """

    resize: int
    crop: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
