"""The admin token: a per-user secret that admin endpoints require as a Bearer token.

Created at first start in the per-user config folder with owner-only
permissions; the tray reads it from there. Web pages cannot read files, so a
page in the user's browser cannot call admin endpoints.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from fastapi import Request

from app.errors import Unauthorized


def load_or_create_token(path: Path) -> str:
    """Read the token, creating it (mode 0600) on first use."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process created it just now
        return path.read_text().strip()
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    return token


def check_bearer(header: str | None, token: str) -> None:
    """Constant-time comparison; a missing or wrong token is 401."""
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not given:
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
    check_bearer(header, request.app.state.vg.admin_token)
