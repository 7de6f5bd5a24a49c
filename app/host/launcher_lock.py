"""One launcher per port and user while it starts: a second double-click starts nothing.

`vramguard run` takes this lock before anything slow (the server's torch import takes
minutes on a first start, while an antivirus scans every library) and holds it for the
tray's whole life. The server's own lock (app/host/instance.py) is taken only after that
import, so without this a person who double-clicks again, seeing nothing yet, got a second
launcher, server and import. A second `run` that finds this lock taken opens the dashboard
when the server answers, and otherwise leaves a note that the first launcher's tray turns
into a notification ("still starting"): the second process has no icon to notify from.
The OS releases the lock when the launcher ends, so a crash never leaves it stale.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from app.host.instance import open_lock, try_lock, unlock
from app.host.user_files import NO_FOLLOW, private_folder


def _paths(folder: Path, port: int) -> tuple[Path, Path]:
    return folder / f"launcher-{port}.lock", folder / f"launched-again-{port}"


class LauncherLock:
    """Held by `vramguard run` from its first moment until its tray quits."""

    def __init__(self, folder: Path, port: int) -> None:
        self.folder = folder
        self.port = port
        self.lock_path, self.note_path = _paths(folder, port)
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Take the lock; False when another launcher holds it. A note left for an
        earlier launcher is cleared: it was not meant for this one."""
        private_folder(self.folder)
        fd = open_lock(self.lock_path, create=True)
        if not try_lock(fd):
            os.close(fd)
            return False
        self._fd = fd
        self.note_path.unlink(missing_ok=True)
        return True

    def launched_again(self) -> bool:
        """Whether a second launch left its note since the last call (which takes it)."""
        try:
            self.note_path.unlink()
        except FileNotFoundError:
            return False
        return True

    def release(self) -> None:
        if self._fd is not None:
            unlock(self._fd)
            os.close(self._fd)
            self._fd = None


def leave_note(folder: Path, port: int) -> None:
    """Tell the launcher holding the lock that a person launched vramguard again. Never
    through a link; one that is there already says the same."""
    _, note = _paths(folder, port)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(note, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_FOLLOW, 0o600))
