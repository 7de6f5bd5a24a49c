"""The API key: what a server that other computers reach asks of every caller.

Set ``api_key_file`` and every request must send ``Authorization: Bearer KEY``, checked
in constant time (``check_bearer``, the admin token's own check). A missing or wrong key
is 401 with ``WWW-Authenticate: Bearer``, before the rate limiter: a stranger without the
key spends no one's tokens (behind a proxy every client has the proxy's address), and a
flood of wrong keys costs what 404s do, a few comparisons and a short answer each (a key
of 32 characters or more cannot be guessed that way).

Open without the key: the health checks (``/healthz``, ``/readyz``, ``/v2/health/*``), so
that load balancers and supervisors need no secret, and ``/v1/identity``, the challenge
``vramguard stop`` and the tray send before they trust the server with the admin token
(it answers only a proof, and costs less than a 404).

Authorization holds one value, and admin calls need the admin token there, so the admin
token and dashboard sessions (given only to holders of that token) are accepted in place
of the key: they are stronger secrets held by the server's own operator. The tray sends
the admin token with its readings once one gets 401 (after the server has proved it
holds that token); its live stream sends that token too, so it follows the stream; the
dashboard page cannot be opened (a browser's navigation sends no header): watch
``/metrics`` (with the key) instead.

The file is read once, when the app is built: a change needs a restart. A file that is
missing, empty, shorter than ``MIN_KEY_CHARS``, not one line of printable characters, or
readable by other users stops the start with a message saying what to fix.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from app.config import ConfigError
from app.errors import Unauthorized
from app.gates import refuse
from app.gates.admin_token import check_bearer
from app.host.token_file import token_file_problem, user_profile
from app.host.user_files import reason
from app.http.scope import authorization
from app.http.stats import RequestStats

MIN_KEY_CHARS = 32
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready",
                        "/v1/identity"})
_KEY = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces: it travels in a header
_MAKE_ONE = ("a key of at least 32 characters on one line, such as what this prints: "
             "python -c \"import secrets; print(secrets.token_urlsafe(32))\"")


class ApiKeyFileError(ConfigError):
    """The API key file cannot be used; the message says why and what to do."""


def load_api_key(path: Path) -> str:
    """The key in ``path``; ApiKeyFileError when it is missing, unreadable, too short or
    not private. The permissions checked are those of the file read (fstat)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        with os.fdopen(fd, "rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            key = handle.read().decode("utf-8", errors="replace").strip()
    except FileNotFoundError:
        raise ApiKeyFileError(f"The API key file {path} (the api_key_file setting) does "
                              f"not exist. Write in it {_MAKE_ONE}, or remove the "
                              "setting to run without a key.") from None
    except OSError as exc:
        raise ApiKeyFileError(f"Cannot read the API key file {path}: {reason(exc)}.") from None
    if not key:
        raise ApiKeyFileError(f"The API key file {path} is empty. Write in it {_MAKE_ONE}.")
    if not _KEY.fullmatch(key):
        raise ApiKeyFileError(f"The API key in {path} is not one line of letters, digits "
                              "and punctuation without spaces (clients send it in a "
                              f"header). Write in it {_MAKE_ONE}.")
    if len(key) < MIN_KEY_CHARS:
        raise ApiKeyFileError(f"The API key in {path} has {len(key)} characters: too few "
                              f"to be safe from guessing. Write in it {_MAKE_ONE}.")
    problem = token_file_problem(path, mode, windows=sys.platform == "win32",
                                 profile=user_profile(), name="API key file",
                                 or_else="and point api_key_file at its new place")
    if problem:
        raise ApiKeyFileError(problem)
    return key


class ApiKeyGate:
    """401 for a request without the key (or the admin token, or a dashboard session,
    which ``is_admin`` recognises); each refusal is counted in ``stats``."""

    def __init__(self, app: ASGIApp, key: str, is_admin: Callable[[str], bool],
                 stats: RequestStats) -> None:
        self.app = app
        self.key = key
        self.is_admin = is_admin
        self.stats = stats

    def allowed(self, header: str) -> bool:
        try:
            check_bearer(header, self.key)
        except Unauthorized:
            return bool(header) and self.is_admin(header)
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = authorization(scope)
        if self.allowed(header):
            await self.app(scope, receive, send)
        elif scope["type"] != "http":  # a WebSocket (the API has none): closed, not let by
            await send({"type": "websocket.close", "code": 1008})
        elif header:
            await refuse(Unauthorized("The API key is wrong: send the key this server's "
                                      "operator gave you, as 'Authorization: Bearer KEY'."),
                         self.stats, scope, receive, send)
        else:
            await refuse(Unauthorized("This server needs its API key: send "
                                      "'Authorization: Bearer KEY' with the key its "
                                      "operator gave you."), self.stats, scope, receive, send)
