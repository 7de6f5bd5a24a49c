"""How the dashboard page gets a few admin rights without the token ever being in a page.

The tray (which can read the token file) asks for a one-time code and writes a private
file that sends the browser to ``/ui#code=…``: the code is in the #fragment (never sent
to servers or kept in logs) and never on a command line, where other users could read
it. The page trades the code, once, within two minutes, for a session token.

A session buys what the tray's menu can do (``SESSION_ACTIONS``): empty the cache, reset
the peak, pause and resume, unload a model, save a support report, stop vramguard; never
asking for a new code, so a session cannot renew itself, nor recording allocations. It
ends ``SESSION_MAX_S`` after the trade, however much it is used. A page from any other
site cannot do the trade: its Origin is refused before any route runs.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

CODE_TTL_S = 120.0
SESSION_MAX_S = 8 * 3600.0
MAX_ENTRIES = 64
SESSION_ACTIONS = frozenset({("POST", "/v1/memory/empty-cache"),
                             ("POST", "/v1/memory/reset-peak"),
                             ("POST", "/v1/admin/pause"), ("POST", "/v1/admin/resume"),
                             ("POST", "/v1/models/{name}/unload"),
                             ("POST", "/v1/admin/shutdown"),
                             ("GET", "/v1/support-report")})
"""(method, route path) of every admin action a dashboard session may take: the tray
menu's; all others need the admin token."""


class UiSessions:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._codes: dict[str, float] = {}
        self._sessions: dict[str, float] = {}

    def _prune(self, table: dict[str, float]) -> None:
        now = self.clock()
        for key in [k for k, expiry in table.items() if expiry < now]:
            del table[key]
        while len(table) >= MAX_ENTRIES:
            del table[min(table, key=table.__getitem__)]

    def new_code(self) -> str:
        self._prune(self._codes)
        code = secrets.token_urlsafe(24)
        self._codes[code] = self.clock() + CODE_TTL_S
        return code

    def redeem(self, code: str) -> str | None:
        """A session token for a valid, unused code; None otherwise (codes work once)."""
        expiry = self._codes.pop(code, None)
        if expiry is None or expiry < self.clock():
            return None
        self._prune(self._sessions)
        token = secrets.token_urlsafe(32)
        self._sessions[token] = self.clock() + SESSION_MAX_S  # fixed now: never extended
        return token

    def valid(self, token: str) -> bool:
        expiry = self._sessions.get(token)
        return expiry is not None and expiry >= self.clock()
