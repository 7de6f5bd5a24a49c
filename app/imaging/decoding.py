"""Safe decoding of untrusted image bytes into the model's 8-bit crop.

Runs in the decode worker processes (``app/imaging/decode_worker.py``), which must start
fast and small: nothing here may import torch or numpy (``app/imaging/pixels.py`` turns the
crop into the model's input, in the server). Every failure becomes a client error
(400, 413 or 422) with a message a person can act on; nothing here may raise
anything else for bad input.

Memory: an image is decoded once at its stored size (JPEG at a reduced scale), then
cropped and shrunk band by band *before* any conversion, so each conversion works
on a small picture. The peak is the decoded picture plus a few megabytes, and
``predicted_peak`` says how much that is before a single pixel is decoded.
"""

from __future__ import annotations

import io
import struct
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from PIL import ExifTags, Image, TiffImagePlugin, UnidentifiedImageError

from app.errors import BadImage, ImageTooLarge
from app.imaging.checks import BASE_PIECES, Structure, check_structure, too_complex
from app.preprocessing import Preprocessing

# Only decoders we trust and need; Pillow would otherwise also try formats such
# as EPS (which runs Ghostscript) on anything it is handed.
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF")
_SIXTEEN_BIT = {"I;16", "I;16L", "I;16B", "I;16N"}
_WITH_ALPHA = {"RGBA", "LA", "PA", "RGBa", "La"}
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, IndexError,
                  TypeError, KeyError, ZeroDivisionError)
_UNREADABLE = ("This is not an image vramguard can read. Send a JPEG, PNG, WebP, BMP, "
               "GIF or TIFF file.")
_ORIENTATION = {
    2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
BAND_BYTES = 4 * 1024**2  # source bytes shrunk per step; its copies are the working set
# Pillow stores one byte per pixel for these modes, two for 16-bit grey, four for the rest
# (RGB included).
_ONE_BYTE = {"1", "L", "P"}
# Bytes per pixel libwebp and Pillow hold while decoding a WebP (measured: 16.1).
_WEBP_BYTES_PER_PIXEL = 16
_TIFF_BITS_PER_SAMPLE, _TIFF_PHOTOMETRIC, _TIFF_YCBCR = 258, 262, 6
_TIFF_ROWS_PER_STRIP, _TIFF_TILE_WIDTH, _TIFF_TILE_LENGTH = 278, 322, 323
# Beside the picture and the band copies: the small output, the decoders' own buffers and
# the allocator's slack (measured: up to 7 MiB for a 40-megapixel float TIFF).
_SLACK_BYTES = 10 * 1024**2


@dataclass(frozen=True)
class Opened:
    """An image whose header has been read and checked; no pixel is decoded yet."""

    image: Image.Image
    peak_bytes: int  # predicted peak memory of decoding it (``predicted_peak``)


@contextmanager
def _as_client_errors() -> Iterator[None]:
    """Turn whatever Pillow raises for bad bytes into the client error it means."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageTooLarge("The image has too many pixels to decode safely.") from None
    except MemoryError:
        raise ImageTooLarge("Opening this image needs more memory than vramguard allows "
                            "for one image. Send a smaller image.") from None
    except UnidentifiedImageError:
        raise BadImage(_UNREADABLE) from None
    except _DECODE_ERRORS:
        raise BadImage("The image file is damaged or incomplete and cannot be read.") from None


def open_image(data: bytes, max_pixels: int, shrink_to: int | None = None) -> Opened:
    """Read and check the header of untrusted bytes, or raise a client error.

    ``shrink_to`` lets a JPEG decode at a reduced scale that is still at least that
    large, which makes big photos several times cheaper to decode.
    """
    if not data:
        raise BadImage("The request has no image in it: the body is empty.")
    structure = check_structure(data)
    with _as_client_errors():
        image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
        width, height = image.size
        if width * height > max_pixels:
            raise ImageTooLarge(
                f"The image is {width}x{height} pixels; the limit is {max_pixels:,} "
                "pixels. Send a smaller image.")
        pieces = BASE_PIECES + len(data) // 1024
        if len(image.tile) > pieces:  # an uncompressed TIFF is read strip by strip in Python
            raise too_complex(f"it is cut into more than {pieces:,} pieces (TIFF strips)")
        full_size = image.size
        if shrink_to and image.format in ("JPEG", "MPO"):
            image.draft("RGB", (shrink_to, shrink_to))
        return Opened(image, predicted_peak(image, full_size, structure, len(data)))


def predicted_peak(image: Image.Image, full_size: tuple[int, int], structure: Structure,
                   input_bytes: int) -> int:
    """Bytes that decoding ``image`` (opened, maybe drafted) and shrinking it will hold at
    their peak: the input, the decoded picture at its stored size, what its decoder keeps
    beside it, and the copies of one band that the shrinking makes."""
    width, height = image.size
    per_pixel = 1 if image.mode in _ONE_BYTE else 2 if image.mode in _SIXTEEN_BIT else 4
    bands = 3 * min(BAND_BYTES, 4 * width * height)  # a band, expanded, premultiplied
    peak = input_bytes + width * height * per_pixel + bands + _SLACK_BYTES
    full_pixels = full_size[0] * full_size[1]
    if image.format in ("JPEG", "MPO") and (structure.jpeg_scans > 1
                                            or image.info.get("progressive")):
        # A JPEG in several scans keeps every DCT coefficient (2 bytes each, one per pixel
        # of each component at its own sampling) until the last scan, at full size.
        peak += int(2 * full_pixels * _jpeg_component_share(image))
    elif image.format == "WEBP":
        peak += full_pixels * (_WEBP_BYTES_PER_PIXEL - per_pixel)  # its canvases and copies
    elif isinstance(image, TiffImagePlugin.TiffImageFile):
        peak += _tiff_buffer(image)
    return peak


def _jpeg_component_share(image: Image.Image) -> float:
    """Sum over components of (its samples per pixel): 1.5 for 4:2:0 colour, 3 for 4:4:4."""
    layers = getattr(image, "layer", None) or []
    if not layers:
        return float(len(image.getbands()))
    h_max = max(layer[1] for layer in layers) or 1
    v_max = max(layer[2] for layer in layers) or 1
    return float(sum(layer[1] * layer[2] for layer in layers)) / (h_max * v_max)


def _tiff_buffer(image: TiffImagePlugin.TiffImageFile) -> int:
    """libtiff decodes a compressed TIFF one strip or tile at a time into a buffer of that
    size, which a crafted file can make the whole picture (YCbCr ones as 4-byte RGBA)."""
    tags = image.tag_v2
    width, height = image.size
    if _TIFF_TILE_WIDTH in tags and _TIFF_TILE_LENGTH in tags:
        pixels = int(tags[_TIFF_TILE_WIDTH]) * int(tags[_TIFF_TILE_LENGTH])
    else:
        pixels = width * min(height, int(tags.get(_TIFF_ROWS_PER_STRIP, height)))
    bits = tags.get(_TIFF_BITS_PER_SAMPLE, (8,))
    total_bits = sum(bits) if isinstance(bits, tuple) else int(bits)
    per_pixel = 4 if tags.get(_TIFF_PHOTOMETRIC) == _TIFF_YCBCR else (total_bits + 7) // 8
    return pixels * per_pixel


def decode(opened: Opened, *, crop: float | None = None,
           shrink_to: int | None = None) -> Image.Image:
    """Decode into an upright RGB image, or raise a client error.

    ``crop`` keeps only the centred square whose side is that share of the short side
    (what the model's centre crop will use); ``shrink_to`` scales down by a whole factor
    that keeps at least that many pixels on each side. Both happen before any mode
    conversion, so conversions never touch the full-size picture.
    """
    image = opened.image
    with _as_client_errors():
        image.load()
        orientation = image.getexif().get(ExifTags.Base.Orientation, 1)
        sixteen_bit = image.mode in _SIXTEEN_BIT
        box = _centre_square(image.size, crop) if crop else (0, 0, *image.size)
        side = min(box[2] - box[0], box[3] - box[1])
        small = _shrink(image, box, max(1, side // shrink_to) if shrink_to else 1)
        image.close()  # the full-size picture is no longer needed
        method = _ORIENTATION.get(orientation)
        if method is not None:
            small = small.transpose(method)
        return to_rgb(small, sixteen_bit=sixteen_bit)


def decode_image(data: bytes, max_pixels: int, shrink_to: int | None = None) -> Image.Image:
    """``open_image`` then ``decode``: the whole image, upright, in RGB."""
    return decode(open_image(data, max_pixels, shrink_to), shrink_to=shrink_to)


RESAMPLING = {"nearest": Image.Resampling.NEAREST, "bilinear": Image.Resampling.BILINEAR,
              "bicubic": Image.Resampling.BICUBIC, "lanczos": Image.Resampling.LANCZOS,
              "box": Image.Resampling.BOX, "hamming": Image.Resampling.HAMMING}


def model_patch(opened: Opened, spec: Preprocessing) -> bytes:
    """The model's centre crop as 8-bit RGB, or grey for a one-channel model (crop x crop
    x channels bytes, row by row), decoding only that crop and shrinking it before
    converting it."""
    image = decode(opened, crop=spec.crop / spec.resize, shrink_to=spec.crop)
    patch = image.resize((spec.crop, spec.crop), RESAMPLING[spec.interpolation])
    return (patch.convert("L") if spec.channels == 1 else patch).tobytes()


def _centre_square(size: tuple[int, int], share: float) -> tuple[int, int, int, int]:
    width, height = size
    side = max(1, round(min(width, height) * share))
    left, top = (width - side) // 2, (height - side) // 2
    return left, top, left + side, top + side


def _shrink(image: Image.Image, box: tuple[int, int, int, int], factor: int) -> Image.Image:
    """Crop ``box`` and reduce it ``factor`` times, a band of rows at a time: each band is
    copied, expanded to a mode that can be averaged, and reduced, so the extra memory is a
    few bands, not a second full-size picture."""
    left, top, right, bottom = box
    row_bytes = 4 * (right - left)
    rows = factor * max(1, BAND_BYTES // (row_bytes * factor))
    parts = []
    for y in range(top, bottom, rows):
        band = _averageable(image.crop((left, y, right, min(y + rows, bottom))))
        parts.append(band.reduce(factor) if factor > 1 else band)
    if len(parts) == 1:
        return parts[0]
    out = Image.new(parts[0].mode, (parts[0].width, sum(part.height for part in parts)))
    y = 0
    for part in parts:
        out.paste(part, (0, y))
        y += part.height
    return out


def _averageable(image: Image.Image) -> Image.Image:
    """The same pixels in a mode whose values may be averaged (palette indices and 1-bit
    pixels may not; Pillow cannot reduce 16-bit grey)."""
    if image.mode == "1":
        return image.convert("L")
    if image.mode in ("P", "PA"):
        alpha = image.mode == "PA" or "transparency" in image.info
        return image.convert("RGBA" if alpha else "RGB")
    if image.mode in _SIXTEEN_BIT:
        return image.convert("I")
    return image


def to_rgb(image: Image.Image, *, sixteen_bit: bool = False) -> Image.Image:
    """Convert any Pillow mode to 8-bit RGB; transparent areas become white.

    ``sixteen_bit``: the pixels came from a 16-bit image (already widened to mode I).
    """
    if sixteen_bit or image.mode in _SIXTEEN_BIT or image.mode in ("I", "F"):
        return _high_depth_to_rgb(image, sixteen_bit or image.mode in _SIXTEEN_BIT)
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in _WITH_ALPHA:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _high_depth_to_rgb(image: Image.Image, sixteen_bit: bool) -> Image.Image:
    """Scale 16-bit or 32-bit grey to 8 bits instead of clipping (Pillow clips)."""
    if image.mode in _SIXTEEN_BIT:
        image = image.convert("I")
    if sixteen_bit:
        top = 65535.0
    else:
        peak = float(image.getextrema()[1])  # type: ignore[arg-type]  # one band: (min, max)
        top = 255.0 if peak <= 255 else 65535.0 if peak <= 65535 else peak
    return image.point(lambda value: value * (255.0 / top)).convert("L").convert("RGB")
