"""Host and Origin checks: why a web page in the user's browser cannot use the API.

DNS rebinding: a page on evil.example re-points its name at 127.0.0.1 and
then talks to us as "evil.example". The Host header gives it away, so only
our own names are accepted (CVE-2024-28224 was Ollama missing this check).
Cross-site requests: a page may still send requests to 127.0.0.1 directly;
the browser then adds an ``Origin`` header, and any origin not allowed gets
403 at the server — not merely a response the page cannot read.

IPv6 literals are parsed properly (``[::1]:8765``), unlike Starlette's
``TrustedHostMiddleware``.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from app.config import LOOPBACK_HOSTS
from app.errors import ApiError
from app.gates import refuse
from app.stats import RequestStats


class Forbidden(ApiError):
    status, code = 403, "forbidden"


def split_host(value: str) -> tuple[str, int | None] | None:
    """'[::1]:8765' -> ('::1', 8765); 'Localhost' -> ('localhost', None); None if malformed."""
    value = value.strip().lower()
    if not value:
        return None
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[1:end], value[end + 1:]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else None
    else:
        name, sep, port_text = value.partition(":")
        if not sep:
            port_text = None
        elif ":" in port_text:
            return None  # a bare IPv6 address without brackets is not a valid Host
    if port_text is None:
        return name, None
    if not port_text.isdigit():
        return None
    return name, int(port_text)


class HostOriginGate:
    """403 for a Host that is not ours or an Origin that is not allowed; each refusal is
    counted in ``stats``."""

    def __init__(self, app: ASGIApp, port: int, extra_hosts: list[str],
                 allowed_origins: list[str], stats: RequestStats) -> None:
        self.app = app
        self.stats = stats
        self.port = port
        self.names = {*LOOPBACK_HOSTS, *(h.lower() for h in extra_hosts)}
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}

    def host_allowed(self, header: str | None) -> bool:
        parsed = split_host(header or "")
        if parsed is None:
            return False
        name, port = parsed
        return name in self.names and port in (self.port, None if self.port == 80 else -1)

    def origin_allowed(self, origin: str) -> bool:
        origin = origin.rstrip("/").lower()
        if origin in self.origins:
            return True
        parts = urlsplit(origin)
        if parts.scheme != "http" or not parts.netloc:
            return False
        return self.host_allowed(parts.netloc)  # our own pages (/docs) are same-origin

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name: value.decode("latin-1") for name, value in scope["headers"]
                   if name in (b"host", b"origin")}
        if not self.host_allowed(headers.get(b"host")):
            error = Forbidden("This address is not allowed. Use http://127.0.0.1:"
                              f"{self.port} or http://localhost:{self.port}.")
        elif b"origin" in headers and not self.origin_allowed(headers[b"origin"]):
            error = Forbidden("Requests from web pages are not allowed unless their origin "
                              "is listed in the cors_origins setting.")
        else:
            await self.app(scope, receive, send)
            return
        await refuse(error, self.stats, scope, receive, send)
