""""Save a support report": the server's report (``/v1/support-report``) written to the
person's Downloads folder (else their home), under a name that never overwrites an
earlier one, so it can be attached to a bug report as it is."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import platformdirs


def downloads_folder() -> Path:
    """Downloads where it exists (Windows, most Linux desktops), else the home folder."""
    folder = Path(platformdirs.user_downloads_dir())
    return folder if folder.is_dir() else Path.home()


def save_report(fetch: Callable[[], bytes], folder: Path,
                now: Callable[[], float] = time.time) -> Path:
    """Fetch the report and write it into ``folder``; the path it was written to. The
    file is created new (``x`` mode): an earlier report of the same second is kept."""
    data = fetch()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now()))
    for attempt in range(100):
        suffix = f"-{attempt}" if attempt else ""
        path = folder / f"vramguard-support-{stamp}{suffix}.zip"
        try:
            with path.open("xb") as out:
                out.write(data)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"{folder} already holds 100 support reports of this second")
