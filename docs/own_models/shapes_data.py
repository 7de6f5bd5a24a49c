"""Synthetic pictures for the "Serve your own model" examples: a red, green or blue shape
on a noisy light-grey background.

The examples cannot download a data set, and a test needs pictures whose right answer is
known, so these are drawn: three classes that a tiny model learns in seconds. With your own
pictures you would not need this file, except ``to_batch``, which prepares pictures the way
vramguard does (so a script can check the answers it should get from vramguard).

Every function is deterministic from its seed: the same seed draws the same pictures.
"""

from __future__ import annotations

import colorsys
import math
import random
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw

LABELS = ["red", "green", "blue"]
HUES = (0.0, 1 / 3, 2 / 3)  # red, green, blue on the colour wheel (0-1)
IMAGENET_MEAN = (0.485, 0.456, 0.406)  # 0-1 units, as timm and Hugging Face write them
IMAGENET_STD = (0.229, 0.224, 0.225)
SIZE = 64  # the examples' models take 64 x 64 pixels
CROP_PCT = 0.875  # the centre crop keeps this share of the short side (the ImageNet habit)
RESIZE = 73  # the short side is scaled to this before the 64-pixel crop: 64 / 0.875, rounded
MARGIN = 0.1  # shapes stay this share of the side away from the edges, inside the centre crop


def _colour(rng: random.Random, label: int) -> tuple[int, int, int]:
    """The class's colour, jittered in hue, saturation and brightness so that no two
    shapes are the same colour (a model must learn "reddish", not one RGB value)."""
    hue = (HUES[label] + rng.uniform(-0.04, 0.04)) % 1.0
    red, green, blue = colorsys.hsv_to_rgb(hue, rng.uniform(0.65, 1.0), rng.uniform(0.55, 0.95))
    return round(255 * red), round(255 * green), round(255 * blue)


def _background(rng: random.Random, noise: np.random.Generator, size: int) -> Image.Image:
    """A light grey of random shade with per-pixel noise."""
    grey = rng.uniform(170, 235)
    pixels = grey + noise.normal(0, 8, (size, size, 1)) + noise.normal(0, 3, (size, size, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def _draw_shape(draw: ImageDraw.ImageDraw, rng: random.Random,
                box: tuple[float, float, float], fill: tuple[int, int, int]) -> None:
    """A circle, square or triangle (turned at random) centred at ``box``'s x, y and fitting
    a circle of its radius."""
    x, y, radius = box
    sides = rng.choice((0, 3, 4))  # 0: a circle
    if sides == 0:
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=fill)
        return
    turn = rng.uniform(0, 2 * math.pi)
    corners = [(x + radius * math.cos(turn + 2 * math.pi * k / sides),
                y + radius * math.sin(turn + 2 * math.pi * k / sides)) for k in range(sides)]
    draw.polygon(corners, fill=fill)


def _place(rng: random.Random, left: float, top: float, side: float,
           share: tuple[float, float]) -> tuple[float, float, float]:
    """A random centre and radius for a shape whose width is ``share`` of a square region."""
    radius = side * rng.uniform(*share) / 2
    return (rng.uniform(left + radius, left + side - radius),
            rng.uniform(top + radius, top + side - radius), radius)


def make_images(count: int, seed: int, size: int = 64) -> list[tuple[Image.Image, int]]:
    """``count`` pictures of one shape each, with its class (an index into LABELS); the
    classes take turns, so each is equally common."""
    rng, noise = random.Random(seed), np.random.default_rng(seed)
    labels = [index % len(LABELS) for index in range(count)]
    rng.shuffle(labels)
    images = []
    for label in labels:
        image = _background(rng, noise, size)
        inner = size * (1 - 2 * MARGIN)
        _draw_shape(ImageDraw.Draw(image), rng,
                    _place(rng, size * MARGIN, size * MARGIN, inner, (0.35, 0.75)),
                    _colour(rng, label))
        images.append((image, label))
    return images


def make_multilabel_images(count: int, seed: int,
                           size: int = 64) -> list[tuple[Image.Image, list[int]]]:
    """``count`` pictures of one to three shapes, each a different class, with the sorted
    classes present. Each shape has its own quarter of the picture, so none hides another."""
    rng, noise = random.Random(seed), np.random.default_rng(seed)
    images = []
    for _ in range(count):
        labels = sorted(rng.sample(range(len(LABELS)), rng.randint(1, len(LABELS))))
        image = _background(rng, noise, size)
        draw = ImageDraw.Draw(image)
        cell = size * (1 - 2 * MARGIN) / 2
        quarters = rng.sample([(0, 0), (0, 1), (1, 0), (1, 1)], len(labels))
        for label, (row, column) in zip(labels, quarters, strict=True):
            left, top = size * MARGIN + column * cell, size * MARGIN + row * cell
            _draw_shape(draw, rng, _place(rng, left, top, cell, (0.6, 0.95)),
                        _colour(rng, label))
        images.append((image, labels))
    return images


def to_batch(images: Sequence[Image.Image], size: int = SIZE, resize: int | None = None,
             mean: Sequence[float] = IMAGENET_MEAN,
             std: Sequence[float] = IMAGENET_STD,
             interpolation: str = "bilinear") -> torch.Tensor:
    """Pictures as the model's input (N x 3 x size x size float32), prepared as vramguard
    prepares them: the centred square that is ``size / resize`` of the short side (what is
    left after resizing the short side to ``resize`` and cropping ``size`` from the centre),
    scaled to ``size`` x ``size`` with ``interpolation`` ("nearest", "bilinear" or
    "bicubic", as in the manifest), then ``(pixel / 255 - mean) / std`` per
    RGB channel (``mean`` and ``std`` in 0-1 units). ``resize`` defaults to size / 0.875.

    Cropping first and scaling once is vramguard's order (it never holds a resized copy of
    a large photo); scaling first and cropping after gives pixels a little different.
    """
    resize = resize or round(size / 0.875)
    offset = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
    scale = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
    batch = []
    for image in images:
        width, height = image.size
        side = max(1, round(min(width, height) * size / resize))
        left, top = (width - side) // 2, (height - side) // 2
        square = image.convert("RGB").crop((left, top, left + side, top + side))
        shrink = max(1, side // size)  # vramguard first averages whole blocks of pixels
        if shrink > 1:
            square = square.reduce(shrink)
        patch = square.resize((size, size), Image.Resampling[interpolation.upper()])
        pixels = torch.from_numpy(np.asarray(patch, dtype=np.float32).copy()).permute(2, 0, 1)
        batch.append((pixels / 255 - offset) / scale)
    return torch.stack(batch)
