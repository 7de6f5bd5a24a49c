"""The structural checks refuse files built to make a decoder work far longer than their
size suggests, before any decoder runs, and let ordinary files through."""

from __future__ import annotations

import io
import struct

import pytest
from images import (
    coffee_image,
    encode,
    gif_block_bomb,
    jpeg_comment_bomb,
    jpeg_with_two_frames,
    odd_valid_images,
    photo,
    png_chunk_bomb,
    scan_bomb,
    tiff_strip_bomb,
)
from PIL import Image

from app.errors import ImageTooComplex
from app.imaging.checks import check_structure
from app.imaging.decoding import open_image

LIMIT = 40_000_000


def test_the_scan_bomb_is_a_jpeg_libjpeg_decodes() -> None:
    """The crafted file is valid: Pillow decodes a small one (libjpeg only warns)."""
    image = Image.open(io.BytesIO(scan_bomb(200, 200, 300)))
    image.load()
    assert image.size == (200, 200)


@pytest.mark.parametrize(("width", "height", "repeats"), [
    (8000, 5000, 2000),  # the case: 40 megapixels, flat, thousands of scans
    (4000, 2000, 200),  # 210 scans of 8 megapixels: past the scans x pixels limit
    (200, 200, 300),  # a small picture, but more scans than any encoder writes
])
def test_a_jpeg_that_repeats_its_scans_is_refused(width: int, height: int,
                                                  repeats: int) -> None:
    with pytest.raises(ImageTooComplex, match="repeats its picture data") as refused:
        check_structure(scan_bomb(width, height, repeats))
    assert refused.value.status == 422
    assert "save it again" in refused.value.message


def test_ordinary_jpegs_pass_with_their_scans_counted() -> None:
    assert check_structure(photo()).jpeg_scans == 1
    progressive = encode(coffee_image(), "JPEG", progressive=True)
    assert check_structure(progressive).jpeg_scans == 10  # libjpeg's own progression
    cmyk = encode(coffee_image().convert("CMYK"), "JPEG", progressive=True)
    assert check_structure(cmyk).jpeg_scans == 18


def test_marker_bytes_inside_metadata_are_not_counted() -> None:
    """Segments are skipped by their length: FF DA inside metadata is not a scan."""
    payload = b"\xff\xda" * 500
    jpeg = photo()
    data = jpeg[:2] + b"\xff\xef" + struct.pack(">H", 2 + len(payload)) + payload + jpeg[2:]
    assert check_structure(data).jpeg_scans == 1


@pytest.mark.parametrize(("name", "crafted", "words"), [
    ("two frames", jpeg_with_two_frames, "more than once"),
    ("jpeg comments", jpeg_comment_bomb, "JPEG segments"),
    ("png chunks", png_chunk_bomb, "PNG chunks"),
    ("gif blocks", gif_block_bomb, "before its picture"),
])
def test_files_in_too_many_pieces_are_refused(name: str, crafted, words: str) -> None:
    with pytest.raises(ImageTooComplex, match=words):
        check_structure(crafted())


def test_a_tiff_in_too_many_strips_is_refused_after_its_header() -> None:
    with pytest.raises(ImageTooComplex, match="TIFF strips"):
        open_image(tiff_strip_bomb(), LIMIT)


@pytest.mark.parametrize("name", sorted(odd_valid_images()))
def test_odd_but_valid_images_pass(name: str) -> None:
    open_image(odd_valid_images()[name], LIMIT)
