"""How a model wants its pixels. A basic type: the models declare it, the decode workers
(which import neither torch nor numpy) and the pixel code follow it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preprocessing:
    """How a model wants its input: resize the short side, centre-crop, normalise.

    ``mean`` and ``std`` are in 0-255 pixel units, one per channel: three for RGB, one
    for grey (``channels``). ``interpolation`` is how the crop is scaled to ``crop``
    pixels: "nearest", "bilinear" or "bicubic".
    """

    resize: int
    crop: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: str = "bilinear"
    channels: int = 3
