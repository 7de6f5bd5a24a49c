"""One server per port and user: an OS file lock held by the running server.

A second launch (a double-click on the shortcut while vramguard runs, say) finds the
lock taken and reads who holds it, instead of failing on a busy port after seconds of
model loading. The lock dies with its process, so a crash never leaves a stale lock;
the JSON beside it only says who holds it.

The files live in a private folder (0700) beside the token file and are never opened
through a link, so no other user can read them, plant a description, or make vramguard
write through a link into a file of theirs. Every PID is recorded with its process's
start time: `vramguard stop` signals a process only while both still match, never a
later process that was given a reused PID.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from app.host.user_files import NO_FOLLOW, private_folder

if sys.platform == "win32":
    import msvcrt
else:
    import fcntl


log = logging.getLogger("vramguard")
PROBE_RETRIES = 4
REPLACE_RETRIES = 5  # an antivirus scanning the new file holds it for a moment (Windows)
START_TOLERANCE_S = 1.0
"""Start times are read from the wall clock (boot time + ticks since boot); a small step
of the clock between writing and checking must not make vramguard a stranger. A reused
PID belongs to a process started long after the one recorded."""


@dataclass(frozen=True)
class RunningInstance:
    """What the running server wrote about itself."""

    pid: int
    port: int
    url: str
    launcher_pid: int | None = None  # the `vramguard run` (tray) that started this server
    started: float | None = None  # create_time of `pid`
    launcher_started: float | None = None  # create_time of `launcher_pid`


def instance_folder(token_file: Path) -> Path:
    """The private folder of the instance files (and the dashboard's launch pages)."""
    return token_file.parent / "run"


def _paths(folder: Path, port: int) -> tuple[Path, Path]:
    return folder / f"instance-{port}.lock", folder / f"instance-{port}.json"


def _stop_marker(folder: Path, port: int) -> Path:
    return folder / f"stopping-{port}"


def request_stop(folder: Path, port: int) -> None:
    """Record that `vramguard stop` is ending the server on this port, so that the tray
    which started it does not take its exit (whatever the status: on Windows an ended
    process exits 15) for a crash and restart it. The next server to start clears it."""
    private_folder(folder)
    marker = _stop_marker(folder, port)
    marker.unlink(missing_ok=True)
    os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_FOLLOW, 0o600))


def stop_requested(folder: Path, port: int, since: float) -> bool:
    """Whether `vramguard stop` asked the server on this port to stop at or after
    ``since`` (wall-clock seconds: when the tray started that server)."""
    try:
        return _stop_marker(folder, port).lstat().st_mtime >= since - START_TOLERANCE_S
    except OSError:
        return False


def open_lock(path: Path, create: bool) -> int:
    flags = os.O_RDWR | NO_FOLLOW | (os.O_CREAT if create else 0)
    return os.open(path, flags, 0o600)


def try_lock(fd: int) -> bool:
    try:
        if sys.platform == "win32":
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        else:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def unlock(fd: int) -> None:
    """Release the lock before its handle is closed: Windows frees a region lock left on a
    closed handle only when it gets round to it, and until then the next server on this
    port (a restart, say) finds the port taken."""
    with contextlib.suppress(OSError):
        if sys.platform == "win32":
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)


def _replace(source: str, target: Path) -> None:
    """os.replace, tried again for a moment while another program holds the target."""
    for attempt in range(REPLACE_RETRIES):
        try:
            os.replace(source, target)
            return
        except PermissionError:
            if attempt == REPLACE_RETRIES - 1:
                raise
            time.sleep(0.05 * 2**attempt)


def _remove(path: Path) -> None:
    """Path.unlink, tried again for a moment while another program holds the file."""
    for attempt in range(REPLACE_RETRIES):
        try:
            path.unlink(missing_ok=True)
            return
        except PermissionError:
            if attempt == REPLACE_RETRIES - 1:
                raise
            time.sleep(0.05 * 2**attempt)


def start_time(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), or None when there is none."""
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def same_process(pid: int | None, started: float | None) -> psutil.Process | None:
    """The live process ``pid`` if it is the one that started at ``started``; None when it
    has ended, or its PID now belongs to another process, or no start time was recorded
    (then nobody can tell, and nothing may be signalled)."""
    if not pid or started is None:
        return None
    try:
        process = psutil.Process(pid)
        if abs(process.create_time() - started) > START_TOLERANCE_S:
            return None
    except psutil.Error:
        return None
    return process


class InstanceLock:
    """Held by `serve` for its whole life; released by the OS when the process ends."""

    def __init__(self, folder: Path, port: int) -> None:
        self.folder = folder
        self.port = port
        self.lock_path, self.info_path = _paths(folder, port)
        self._fd: int | None = None

    def acquire(self, url: str, launcher_pid: int | None = None) -> bool:
        """Take the lock and record who we are; False if another process holds it."""
        private_folder(self.folder)
        fd = open_lock(self.lock_path, create=True)
        # A few tries: is_held() in another launch takes the lock for a moment to probe it.
        for _ in range(PROBE_RETRIES):
            if try_lock(fd):
                break
            time.sleep(0.05)
        else:
            os.close(fd)
            return False
        self._fd = fd
        _stop_marker(self.folder, self.port).unlink(missing_ok=True)  # an earlier stop's
        try:
            self._describe(url, launcher_pid)
        except OSError:
            self.release()
            raise
        return True

    def _describe(self, url: str, launcher_pid: int | None) -> None:
        """Write who holds the lock: a new private file (mkstemp: O_EXCL, and O_NOFOLLOW
        where the OS has it) renamed over the old one, which replaces a link rather than
        writing through it."""
        started = start_time(os.getpid())
        launcher_started = start_time(launcher_pid) if launcher_pid else None
        if launcher_started is not None and started is not None and \
                launcher_started > started:
            launcher_started = None  # started after us: not our launcher, a reused PID
        info = {"pid": os.getpid(), "port": self.port, "url": url, "started": started,
                "launcher_pid": launcher_pid, "launcher_started": launcher_started}
        fd, temporary = tempfile.mkstemp(dir=self.folder, prefix=".instance-")  # 0600
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(info, handle)
            _replace(temporary, self.info_path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)

    def release(self) -> None:
        """Remove the description, then always unlock: on Windows another program that
        has the file open (an antivirus, a second launch reading it) makes the removal
        fail for a moment; it is tried again, then left (a stale description is read
        only while the lock is held, so it misleads nobody), never raised past the
        unlock, or the next server on this port would find the port taken."""
        if self._fd is not None:
            try:
                _remove(self.info_path)
            except OSError as exc:
                log.warning("could not remove %s (%s); it is ignored once this server "
                            "has ended", self.info_path, exc.strerror or exc)
            finally:
                unlock(self._fd)
                os.close(self._fd)
                self._fd = None


def is_held(folder: Path, port: int) -> bool:
    """Whether a live process holds the lock for this port (probed by trying to take it)."""
    lock_path, _ = _paths(folder, port)
    try:
        fd = open_lock(lock_path, create=False)
    except OSError:  # none, or a link: nobody holds a lock there
        return False
    try:
        if not try_lock(fd):
            return True
        unlock(fd)
        return False
    finally:
        os.close(fd)


def _read_info(path: Path) -> dict[str, object]:
    fd = os.open(path, os.O_RDONLY | NO_FOLLOW)
    with os.fdopen(fd, encoding="utf-8") as handle:
        info = json.load(handle)
    if not isinstance(info, dict):
        raise ValueError("not a description")
    return info


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and value else None


def running_instance(folder: Path, port: int) -> RunningInstance | None:
    """The server that holds this port's lock, or None when none runs."""
    if not is_held(folder, port):
        return None
    _, info_path = _paths(folder, port)
    try:
        info = _read_info(info_path)
        launcher = _number(info.get("launcher_pid"))
        return RunningInstance(int(_number(info["pid"]) or 0), port, str(info["url"]),
                               int(launcher) if launcher else None,
                               _number(info.get("started")),
                               _number(info.get("launcher_started")))
    except (OSError, ValueError, KeyError, TypeError):
        # Held but not described (the holder is between lock and write), or described
        # through a link: known only by its port, never signalled.
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
