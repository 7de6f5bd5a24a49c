"""Images the tests make: odd-but-valid ones that must classify, broken ones that must not."""

from __future__ import annotations

import io
import struct
import zlib
from functools import cache
from pathlib import Path

import numpy as np
from PIL import Image

DATA = Path(__file__).parent / "data"


def photo(name: str = "coffee.jpg") -> bytes:
    return (DATA / name).read_bytes()


def encode(image: Image.Image, fmt: str, **params: object) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **params)
    return out.getvalue()


def coffee_image() -> Image.Image:
    return Image.open(DATA / "coffee.jpg").convert("RGB")


def sixteen_bit_png() -> bytes:
    grey = np.asarray(coffee_image().convert("L"), dtype=np.uint16) * 257
    return encode(Image.fromarray(grey), "PNG")


def cmyk_jpeg() -> bytes:
    return encode(coffee_image().convert("CMYK"), "JPEG")


def palette_png_with_transparency() -> bytes:
    image = coffee_image().convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    return encode(image, "PNG", transparency=0)


def animated_gif() -> bytes:
    first = coffee_image()
    second = Image.new("RGB", first.size, (0, 0, 255))
    return encode(first, "GIF", save_all=True, append_images=[second], duration=100)


@cache
def odd_valid_images() -> dict[str, bytes]:
    """Each must be classified (200)."""
    rgba = coffee_image().convert("RGBA")
    return {
        "1x1": encode(Image.new("RGB", (1, 1), (200, 30, 30)), "PNG"),
        "20000x20": encode(Image.new("RGB", (20000, 20), (30, 200, 30)), "PNG"),
        "16-bit png": sixteen_bit_png(),
        "cmyk jpeg": cmyk_jpeg(),
        "palette png with transparency": palette_png_with_transparency(),
        "animated gif": animated_gif(),
        "webp": encode(coffee_image(), "WEBP"),
        "bmp": encode(coffee_image(), "BMP"),
        "tiff": encode(coffee_image(), "TIFF"),
        "rgba png": encode(rgba, "PNG"),
        "grey+alpha png": encode(rgba.convert("LA"), "PNG"),
    }


def _chunk(kind: bytes, body: bytes) -> bytes:
    return (struct.pack(">I", len(body)) + kind + body
            + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))


def png_header(side: int, idat: bytes = b"") -> bytes:
    """A greyscale PNG that claims side x side pixels, with the given compressed data."""
    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat)
            + _chunk(b"IEND", b""))


@cache
def decompression_bomb(side: int) -> bytes:
    """A complete, valid PNG of side x side black pixels: tiny on the wire, huge decoded."""
    return png_header(side, zlib.compress(b"".join(b"\x00" + bytes(side) for _ in range(side)), 9))


def png_with_lying_header() -> bytes:
    """A PNG whose header says 4000x4000 but whose data is a 10x10 image."""
    real = bytearray(encode(Image.new("RGB", (10, 10), (1, 2, 3)), "PNG"))
    real[16:24] = struct.pack(">II", 4000, 4000)
    crc = zlib.crc32(bytes(real[12:29])) & 0xFFFFFFFF
    real[29:33] = struct.pack(">I", crc)
    return bytes(real)


@cache
def bad_images() -> dict[str, bytes]:
    """Bodies with an image Content-Type that must be refused with 400 or 413."""
    jpeg = photo()
    return {
        "empty": b"",
        "random bytes": np.random.default_rng(7).bytes(5000),
        "truncated jpeg": jpeg[: len(jpeg) // 3],
        "png with lying header": png_with_lying_header(),
        "html": b"<!doctype html><html><body>not an image</body></html>",
        "pdf": b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF",
        "svg as jpeg": b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>',
    }
