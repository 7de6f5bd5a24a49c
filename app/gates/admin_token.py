"""The admin gate for admin endpoints: the admin token as a Bearer token (constant-time),
or a dashboard session for the few actions a session may take. The token itself, its
file and the identity proof are in ``app/host/token_file.py``."""

from __future__ import annotations

import hmac

from fastapi import Request

from app.errors import AdminTokenRequired, Unauthorized
from app.gates.ui_session import SESSION_ACTIONS, SESSION_MAX_S


def check_bearer(header: str | None, token: str) -> None:
    """Constant-time comparison; a missing or wrong token is 401."""
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip() or not token:
        raise Unauthorized("This needs the admin token: send 'Authorization: Bearer <token>' "
                           "with the token from vramguard's admin-token file.")
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise Unauthorized("The admin token is wrong.")


def require_admin(request: Request) -> None:
    """FastAPI dependency for admin endpoints: the admin token, or a dashboard session for
    the few actions a session may take (listed in ``SESSION_ACTIONS`` by route path, such
    as ``/v1/models/{name}/unload``: a new admin route is closed to sessions until it is
    added there)."""
    header = request.headers.get("authorization") or ""
    scheme, _, given = header.partition(" ")
    if scheme.lower() == "bearer" and request.app.state.vg.ui_sessions.valid(given.strip()):
        route = request.scope.get("route")
        if (request.method, getattr(route, "path", None)) in SESSION_ACTIONS:
            return
        raise AdminTokenRequired("The dashboard can do what the tray menu does, nothing "
                                 "more; this needs the admin token (a script that reads "
                                 "the token file).")
    try:
        check_bearer(header, request.app.state.vg.admin_token.current())
    except Unauthorized:
        if scheme.lower() == "bearer" and given.strip():
            raise Unauthorized(f"The admin token is wrong, or this dashboard session has "
                               f"ended (they last {SESSION_MAX_S / 3600:g} hours): open "
                               "the dashboard again from the tray icon.") from None
        raise
