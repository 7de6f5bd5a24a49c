"""A real, small filesystem (tmpfs) for tests of a disk that is or becomes full: root
mounts it; elsewhere the test is skipped."""

from __future__ import annotations

import contextlib
import gc
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted(mount: Path, size: str) -> Iterator[Path]:
    """``mount`` as a tmpfs of ``size`` (e.g. "1m") until the block ends."""
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        gc.collect()  # open database connections on pool threads close when collected
        subprocess.run(["umount", str(mount)], check=False)


def fill(disk: Path) -> None:
    """Write until the disk refuses."""
    with (disk / "filler").open("wb", buffering=0) as filler, contextlib.suppress(OSError):
        while True:
            filler.write(b"\0" * 4096)
