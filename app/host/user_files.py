"""The files vramguard keeps in the user's folders (admin token, log, result cache),
checked before the server starts: a full disk or a folder without permission gives one
message that names the file and what to do, never a traceback.

Only the admin token is essential. Without a writable log folder vramguard logs to its
window only; without a writable cache folder it runs without the result cache.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from app.host.token_file import InsecureTokenFile, load_or_create_token

PROBE_BYTES = 64 * 1024  # a small write that a full disk refuses
NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)  # POSIX; Windows has no such flag (nor the attack)


class UnsafeFolder(OSError):
    """A folder vramguard keeps private files in is a link, or belongs to another user."""


def private_folder(folder: Path) -> Path:
    """``folder``, created (mode 0700) or made owner-only, for files other users must not
    read or plant (instance files, dashboard launch pages). A link in its place, or a
    folder of another user, is refused rather than followed or used."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    info = os.lstat(folder)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafeFolder(f"{folder} is a link or a file, not a folder. Remove it: "
                           "vramguard makes a new one")
    if sys.platform != "win32":
        if info.st_uid != os.geteuid():
            raise UnsafeFolder(f"{folder} belongs to another user. Remove it: vramguard "
                               "makes a new one")
        if stat.S_IMODE(info.st_mode) != 0o700:
            os.chmod(folder, 0o700)
    return folder


def create_private(path: Path, data: bytes) -> None:
    """Write a new file only this user can read (0600), never through a link and never
    over an existing file (O_EXCL)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_FOLLOW
                 | getattr(os, "O_BINARY", 0), 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def reason(exc: OSError) -> str:
    """Why a file operation failed, in words a person can act on."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full. Free some space on it"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return ("permission denied: it belongs to another user or is read-only. Make it "
                "yours, or remove it so vramguard can make a new one")
    if exc.errno == errno.EROFS:
        return "the disk is read-only"
    if exc.errno == errno.ELOOP:
        return ("a link is where vramguard keeps a private file (it never writes through "
                "links there). Remove the link")
    return exc.strerror or str(exc)


def folder_problem(folder: Path) -> str | None:
    """Why vramguard could not write in ``folder`` now, or None when it can."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-test-")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(b"\0" * PROBE_BYTES)
                handle.flush()
                os.fsync(handle.fileno())
        finally:
            with contextlib.suppress(OSError):
                os.unlink(probe)
    except OSError as exc:
        return reason(exc)
    return None


@dataclass(frozen=True)
class UserFiles:
    """What the start-up check found: the token, or why there is none, and warnings."""

    token: str | None
    fatal: str | None
    warnings: tuple[str, ...]
    log_ok: bool
    cache_ok: bool


def check_user_files(token_file: Path, log_dir: Path, cache_dir: Path | None) -> UserFiles:
    """Read (or create) the admin token and test the log and cache folders."""
    token: str | None = None
    fatal = None
    try:
        token = load_or_create_token(token_file)
    except InsecureTokenFile as exc:
        fatal = f"{exc}. Then start vramguard again."
    except OSError as exc:
        fatal = (f"cannot read or create the admin token file {token_file}: {reason(exc)}. "
                 "Then start vramguard again.")
    warnings = []
    log_problem = folder_problem(log_dir)
    if log_problem:
        warnings.append(f"cannot write the log file in {log_dir}: {log_problem} (or set "
                        "log_dir). Logging to this window only for now.")
    cache_problem = folder_problem(cache_dir) if cache_dir is not None else None
    if cache_problem:
        warnings.append(f"cannot use the result cache in {cache_dir}: {cache_problem} (or "
                        "set cache_dir). Running without the result cache for now.")
    return UserFiles(token, fatal, tuple(warnings), log_problem is None,
                     cache_problem is None)
