"""Cheap structural checks of untrusted image bytes, before any decoder sees them.

A small file can make a decoder work for minutes without ever being invalid: a
progressive JPEG may repeat its scans as often as it likes (libjpeg only warns),
and Pillow walks PNG chunks, GIF blocks and JPEG marker segments one at a time in
Python. Each walk here stops as soon as a count passes its limit, so the check
costs little whatever the file holds. The decode worker's CPU limit
(``app/imaging/decode_pool.py``) is the backstop for anything these checks miss.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from app.errors import ImageTooComplex

# A progressive JPEG from libjpeg has 10 scans (6 for grey, 18 for CMYK); each scan
# passes over every block of its component, so the cost grows with scans x pixels.
# The limit allows 32 full passes over a 40-megapixel image.
MAX_SCAN_PIXELS = 32 * 40_000_000
MAX_SCANS = 256
MAX_JPEG_SEGMENTS = 2000  # header segments; ordinary files have a few dozen
# Pieces that Pillow handles one by one in Python: beyond a base, one per KiB of file
# for PNG chunks (encoders write 8-64 KiB each) and one per 256 bytes for GIF blocks.
BASE_PIECES = 1024

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# In entropy-coded data 0xFF is followed by 0x00 (a stuffed byte), RSTn or more 0xFF
# fill bytes; any other byte after 0xFF is the next marker.
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_SOF = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7,
                  0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))
_STANDALONE = frozenset((0x01, *range(0xD0, 0xD8)))  # TEM and RSTn: no length field
_RESAVE = "Open it in an image editor and save it again, or send another image."


@dataclass(frozen=True)
class Structure:
    """What the checks learned that the memory prediction needs."""

    jpeg_scans: int = 0


def check_structure(data: bytes) -> Structure:
    """Refuse files whose structure would make decoding far costlier than their size
    suggests (ImageTooComplex); formats not checked here pass unchanged."""
    if data.startswith(b"\xff\xd8"):
        return Structure(jpeg_scans=_jpeg_scans(data))
    if data.startswith(_PNG_SIGNATURE):
        _check_png(data)
    elif data[:6] in (b"GIF87a", b"GIF89a"):
        _check_gif(data)
    return Structure()


def too_complex(what: str) -> ImageTooComplex:
    """The refusal, in words for the person who sent the file."""
    return ImageTooComplex(f"This image file is built in an unusual way: {what}. Opening it would "
                    f"take far longer than an ordinary image of its size. {_RESAVE}")


def _jpeg_scans(data: bytes) -> int:
    """Walk the marker segments of the first image (up to EOI); count frames and scans."""
    pos, segments, frames, scans, pixels = 2, 0, 0, 0, 0
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            break  # not a marker: the decoder reports the damage
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker == 0xD9:  # EOI: what follows (an MPO's next picture) is not decoded
            break
        if marker in _STANDALONE:
            pos += 2
            continue
        segments += 1
        if segments > MAX_JPEG_SEGMENTS:
            raise too_complex(f"it has more than {MAX_JPEG_SEGMENTS} JPEG segments")
        (length,) = struct.unpack_from(">H", data, pos + 2)
        end = pos + 2 + length
        if marker in _SOF:
            frames += 1
            if frames > 1:
                raise too_complex("it describes its picture more than once")
            if pos + 9 <= len(data):
                height, width = struct.unpack_from(">HH", data, pos + 5)
                pixels = width * height
        if marker == 0xDA:
            scans += 1
            if scans > MAX_SCANS or scans * pixels > MAX_SCAN_PIXELS:
                raise too_complex(f"it repeats its picture data at least {scans} times, "
                                   "where an ordinary JPEG does so at most about 20 times")
            found = _NEXT_MARKER.search(data, end)
            end = found.start() if found else len(data)
        pos = end
    return scans


def _check_png(data: bytes) -> None:
    """Count chunks (Pillow reads each one in Python) up to IEND."""
    limit = BASE_PIECES + len(data) // 1024
    pos, chunks = len(_PNG_SIGNATURE), 0
    while pos + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, pos)
        chunks += 1
        if chunks > limit:
            raise too_complex(f"it is cut into more than {limit:,} pieces (PNG chunks)")
        if kind == b"IEND":
            return
        pos += 12 + length


def _check_gif(data: bytes) -> None:
    """Count the blocks and sub-blocks before the first picture (Pillow reads those in
    Python; the picture's own data is read by the decoder)."""
    limit = BASE_PIECES + len(data) // 256
    flags = data[10] if len(data) > 10 else 0
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    blocks = 0
    while pos < len(data) and data[pos] == 0x21:  # an extension: label, then sub-blocks
        pos += 2
        while pos < len(data):
            blocks += 1
            if blocks > limit:
                raise too_complex(f"it has more than {limit:,} pieces before its picture")
            size = data[pos]
            pos += 1 + size
            if size == 0:
                break
