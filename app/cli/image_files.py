"""The files `vramguard classify` sends, opened as the untrusted input they are.

The rules: only a regular file is sent (a pipe would hang the command, a device such as
``/dev/zero`` would never end); it is opened without blocking and checked after opening
(what was looked at is what is read); one larger than the server takes per image
(``max_body_bytes``) is skipped before a byte of it is read, so a huge or sparse file
costs nothing; the rest is read in chunks as the connection takes them, never whole, and
no more than the size it had when opened. A file's name goes into its part's header
percent-encoded wherever it is not plain printable ASCII, so any name (one that is not
valid UTF-8 included) can be sent.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from app.units import human_bytes

CHUNK = 1024**2  # bytes read (and sent) at a time
NAME_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) not in '"%\\')


class NotSendable(OSError):
    """The file is not sent; ``strerror`` says why, for the person."""


def not_regular(path: Path) -> str | None:
    """Why ``path`` (followed if it is a link) is not a regular file, or None."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None  # the read says why
    if stat.S_ISREG(mode):
        return None
    kind = ("a folder" if stat.S_ISDIR(mode) else "a pipe" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device")
    return f"it is {kind}, not a file"


@dataclass
class ImageFile:
    """An open image file and the size it had when opened."""

    handle: int
    size: int

    def chunks(self) -> Iterator[bytes]:
        """Its bytes, CHUNK at a time, at most ``size`` of them (a file that grows while
        it is sent is cut at the size it had)."""
        left = self.size
        while left > 0:
            data = os.read(self.handle, min(CHUNK, left))
            if not data:
                return
            left -= len(data)
            yield data

    def close(self) -> None:
        os.close(self.handle)


def open_image_file(path: Path, limit: int) -> ImageFile:
    """``path`` opened for sending, or NotSendable (an OSError) saying why not."""
    # O_NONBLOCK: opening a pipe does not wait for a writer (it has no effect on a file).
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    handle = os.open(path, flags)
    try:
        info = os.fstat(handle)
        if not stat.S_ISREG(info.st_mode):
            raise NotSendable(0, not_regular(path) or "it is not a file")
        if info.st_size > limit:
            raise NotSendable(0, f"it is {human_bytes(info.st_size)}, more than the "
                              f"{human_bytes(limit)} vramguard takes per image "
                              "(max_body_bytes)")
    except BaseException:
        os.close(handle)
        raise
    return ImageFile(handle, info.st_size)


def part_name(path: Path) -> str:
    """The file's name as its part's header may carry it."""
    return quote(os.fsencode(path.name), safe=NAME_SAFE)
