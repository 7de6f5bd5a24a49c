"""A folder of images for `vramguard classify`: good ones in a folder and a subfolder, two
broken ones, and a file that is no image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from images import encode, photo
from PIL import Image

__all__ = ["noisy_jpeg", "photo_tree"]


def noisy_jpeg(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    return encode(Image.fromarray(pixels), "JPEG")


def photo_tree(tmp_path: Path) -> dict[str, Path]:
    """Images in a folder and a subfolder, two broken ones, and a file that is no image."""
    root = tmp_path / "photos"
    (root / "trip").mkdir(parents=True)
    files = {"a": root / "a.jpg", "b": root / "trip" / "b.PNG", "c": root / "c.webp",
             "noise": root / "noise.jpg", "cut": root / "trip" / "cut.jpg"}
    files["a"].write_bytes(noisy_jpeg(1))
    files["b"].write_bytes(encode(Image.new("RGB", (30, 20), (9, 99, 199)), "PNG"))
    files["c"].write_bytes(encode(Image.new("RGB", (16, 16), (200, 0, 0)), "WEBP"))
    files["noise"].write_bytes(np.random.default_rng(2).bytes(4000))
    files["cut"].write_bytes(photo()[:3000])
    (root / "notes.txt").write_text("not an image")
    return files
