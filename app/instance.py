"""One server per port and user: an OS file lock held by the running server.

A second launch (a double-click on the shortcut while vramguard runs, say) finds the
lock taken and reads who holds it, instead of failing on a busy port after seconds of
model loading. The lock dies with its process, so a crash never leaves a stale lock;
the JSON beside it only says who holds it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

if sys.platform == "win32":
    import msvcrt
else:
    import fcntl


PROBE_RETRIES = 4


@dataclass(frozen=True)
class RunningInstance:
    """What the running server wrote about itself."""

    pid: int
    port: int
    url: str
    launcher_pid: int | None = None  # the `vramguard run` (tray) that started this server


def _paths(folder: Path, port: int) -> tuple[Path, Path]:
    return folder / f"instance-{port}.lock", folder / f"instance-{port}.json"


def _try_lock(handle: IO[Any]) -> bool:
    try:
        if sys.platform == "win32":
            handle.seek(0)
            msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
        else:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


class InstanceLock:
    """Held by `serve` for its whole life; released by the OS when the process ends."""

    def __init__(self, folder: Path, port: int) -> None:
        self.folder = folder
        self.port = port
        self.lock_path, self.info_path = _paths(folder, port)
        self._handle: IO[Any] | None = None

    def acquire(self, url: str, launcher_pid: int | None = None) -> bool:
        """Take the lock and record who we are; False if another process holds it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        handle = open(self.lock_path, "a+")  # noqa: SIM115 - held until release()
        # A few tries: is_held() in another launch takes the lock for a moment to probe it.
        for _ in range(PROBE_RETRIES):
            if _try_lock(handle):
                break
            time.sleep(0.05)
        else:
            handle.close()
            return False
        self._handle = handle
        info = {"pid": os.getpid(), "port": self.port, "url": url,
                "launcher_pid": launcher_pid}
        temporary = self.info_path.with_suffix(".tmp")
        temporary.write_text(json.dumps(info), encoding="utf-8")
        os.replace(temporary, self.info_path)
        return True

    def release(self) -> None:
        if self._handle is not None:
            self.info_path.unlink(missing_ok=True)
            self._handle.close()
            self._handle = None


def is_held(folder: Path, port: int) -> bool:
    """Whether a live process holds the lock for this port (probed by trying to take it)."""
    lock_path, _ = _paths(folder, port)
    if not lock_path.exists():
        return False
    with open(lock_path, "a+") as handle:
        return not _try_lock(handle)


def running_instance(folder: Path, port: int) -> RunningInstance | None:
    """The server that holds this port's lock, or None when none runs."""
    if not is_held(folder, port):
        return None
    _, info_path = _paths(folder, port)
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
        launcher = info.get("launcher_pid")
        return RunningInstance(int(info["pid"]), int(info["port"]), str(info["url"]),
                               int(launcher) if launcher else None)
    except (OSError, ValueError, KeyError, TypeError):
        # Held but not yet described (the holder is between lock and write).
        return RunningInstance(0, port, f"http://127.0.0.1:{port}")


def running_instances(folder: Path) -> list[RunningInstance]:
    """Every live vramguard server of this user (what `vramguard stop` stops)."""
    found = []
    for lock_path in sorted(folder.glob("instance-*.lock")):
        port = lock_path.stem.removeprefix("instance-")
        if port.isdigit():
            instance = running_instance(folder, int(port))
            if instance is not None:
                found.append(instance)
    return found
