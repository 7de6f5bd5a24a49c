"""Images the tests make: odd-but-valid ones that must classify, broken ones that must not."""

from __future__ import annotations

import io
import struct
import zlib
from functools import cache
from pathlib import Path

import numpy as np
from PIL import Image

DATA = Path(__file__).resolve().parents[1] / "data"


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


# --- crafted files: cheap to send, expensive to decode -----------------------------------


def _jpeg_segments(data: bytes) -> list[tuple[int, int, int]]:
    """(start, end, marker) of each segment up to EOI; a scan's entropy-coded data counts as
    part of its SOS segment."""
    segments, pos = [], 2
    while data[pos + 1] != 0xD9:
        marker = data[pos + 1]
        end = pos + 2 + struct.unpack_from(">H", data, pos + 2)[0]
        if marker == 0xDA:  # skip stuffed bytes (FF 00) and restart markers (FF D0-D7)
            while not (data[end] == 0xFF and data[end + 1] not in (0, *range(0xD0, 0xD8))):
                end += 1
        segments.append((pos, end, marker))
        pos = end
    return segments


@cache
def scan_bomb(width: int = 8000, height: int = 5000, repeats: int = 2000) -> bytes:
    """A valid progressive JPEG of flat grey whose first AC scan (with its Huffman table) is
    repeated ``repeats`` times: libjpeg only warns about the repetition, and every copy
    passes over all the image's blocks again. 40 MP, 2000 repeats: about 400 KB."""
    base = encode(Image.new("RGB", (width, height), (120, 120, 120)), "JPEG",
                  progressive=True, quality=90)
    segments = _jpeg_segments(base)
    scans = [i for i, (_, _, marker) in enumerate(segments) if marker == 0xDA]
    first_ac = scans[1]
    start = segments[first_ac - 1][0] if segments[first_ac - 1][2] == 0xC4 else \
        segments[first_ac][0]
    piece = base[start:segments[first_ac][1]]
    eoi = segments[-1][1]
    return base[:eoi] + piece * repeats + b"\xff\xd9"


def jpeg_with_two_frames() -> bytes:
    """A JPEG whose header describes its picture twice (two SOF segments)."""
    jpeg = photo()
    sof = jpeg.index(b"\xff\xc0")
    length = struct.unpack_from(">H", jpeg, sof + 2)[0]
    return jpeg[:sof] + jpeg[sof:sof + 2 + length] + jpeg[sof:]


def jpeg_comment_bomb(comments: int = 5000) -> bytes:
    """A photo with thousands of empty comment segments before its picture."""
    jpeg = photo()
    return jpeg[:2] + b"\xff\xfe\x00\x02" * comments + jpeg[2:]


def png_chunk_bomb(chunks: int = 20_000) -> bytes:
    """A small PNG with thousands of tiny text chunks before its pixels."""
    small = encode(Image.new("L", (16, 16)), "PNG")
    cut = small.index(b"IDAT") - 4
    return small[:cut] + _chunk(b"tEXt", b"a\x00b") * chunks + small[cut:]


def gif_block_bomb(blocks: int = 50_000) -> bytes:
    """A small GIF with thousands of comment blocks before its picture."""
    gif = encode(Image.new("L", (16, 16)), "GIF")
    flags = gif[10]
    cut = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    return gif[:cut] + b"\x21\xfe\x01a\x00" * blocks + gif[cut:]


def tiff_strip_bomb(rows: int = 50_000) -> bytes:
    """An uncompressed TIFF one pixel wide, one row per strip: Pillow reads each strip as a
    separate piece in Python."""
    return encode(Image.new("L", (1, rows), 7), "TIFF", tiffinfo={278: 1})


MEMORY_SIDE = 6324  # 40 megapixels, the default pixel limit


@cache
def flat_image(mode: str, fmt: str, side: int = MEMORY_SIDE) -> bytes:
    """A flat side x side image: a few hundred KB on the wire, hundreds of MB decoded."""
    value = {"I;16": 1000, "F": 0.5, "RGBA": (10, 20, 30, 128)}.get(mode, 7)
    params = {"compression": "tiff_deflate"} if fmt == "TIFF" else {}
    return encode(Image.new(mode, (side, side), value), fmt, **params)


def memory_bombs() -> dict[str, bytes]:
    """The issue's three: a 16-bit PNG, a float TIFF and an RGBA PNG of 40 megapixels."""
    return {"16-bit png": flat_image("I;16", "PNG"), "float tiff": flat_image("F", "TIFF"),
            "rgba png": flat_image("RGBA", "PNG")}
