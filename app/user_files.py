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
import tempfile
from dataclasses import dataclass
from pathlib import Path

from app.gates.admin_token import load_or_create_token

PROBE_BYTES = 64 * 1024  # a small write that a full disk refuses


def reason(exc: OSError) -> str:
    """Why a file operation failed, in words a person can act on."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full. Free some space on it"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return ("permission denied: it belongs to another user or is read-only. Make it "
                "yours, or remove it so vramguard can make a new one")
    if exc.errno == errno.EROFS:
        return "the disk is read-only"
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
