"""The admin token: a per-user secret that admin endpoints require as a Bearer token.

Created at first start in the per-user config folder with owner-only
permissions; the tray reads it from there. Web pages cannot read files, so a
page in the user's browser cannot call admin endpoints.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import tempfile
from pathlib import Path

from fastapi import Request

from app.errors import Unauthorized

log = logging.getLogger("vramguard.gates")


def load_or_create_token(path: Path) -> str:
    """Read the token, creating it (mode 0600) on first use or when the file is empty."""
    return _read(path) or _create(path, secrets.token_urlsafe(32))


def _create(path: Path, token: str) -> str:
    """Write ``token`` to ``path`` unless another process has just written one; return the
    token the file holds.

    The new file appears whole: it is written under a temporary name, then linked into
    place, so no reader ever sees an empty token file from a creator that crashed or has
    not written yet.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".admin-token-")  # mode 0600
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(token + "\n")
        try:
            os.link(temporary, path)  # fails if another process created it meanwhile
        except FileExistsError:
            existing = _read(path)
            if existing:
                return existing
            os.replace(temporary, path)  # an empty file left behind: replace it
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    return token


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""


class AdminToken:
    """The admin token as its file says now. The tray and scripts read the file, so the
    server follows it: a changed file is re-read, and a file deleted while vramguard runs
    is written back with the current token, so nobody is locked out until a restart."""

    def __init__(self, path: Path, token: str) -> None:
        self.path = path
        self._token = token
        self._seen = self._identity()

    def _identity(self) -> tuple[int, int, int] | None:
        try:
            info = self.path.stat()
        except OSError:
            return None
        return info.st_ino, info.st_mtime_ns, info.st_size

    def current(self) -> str:
        seen = self._identity()
        if seen != self._seen:
            try:
                self._token = _read(self.path) or _create(self.path, self._token)
            except OSError:
                log.warning("cannot read or write the admin token file %s; keeping the "
                            "token vramguard started with", self.path)
            self._seen = self._identity()
        return self._token


def check_bearer(header: str | None, token: str) -> None:
    """Constant-time comparison; a missing or wrong token is 401."""
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip() or not token:
        raise Unauthorized("This needs the admin token: send 'Authorization: Bearer <token>' "
                           "with the token from vramguard's admin-token file.")
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise Unauthorized("The admin token is wrong.")


def require_admin(request: Request) -> None:
    """FastAPI dependency for admin endpoints: the admin token or a dashboard session."""
    header = request.headers.get("authorization") or ""
    scheme, _, given = header.partition(" ")
    if scheme.lower() == "bearer" and request.app.state.vg.ui_sessions.valid(given.strip()):
        return
    check_bearer(header, request.app.state.vg.admin_token.current())
