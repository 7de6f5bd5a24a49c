"""Host and Origin checks: why a web page in the user's browser cannot use the API.

DNS rebinding: a page on evil.example re-points its name at 127.0.0.1 and
then talks to us as "evil.example". The Host header gives it away, so only
our own names are accepted (CVE-2024-28224 was Ollama missing this check): the
loopback ones with our port, and the public names in ``allowed_hosts`` (``is_public``).
Cross-site requests: a page may still send requests to 127.0.0.1 directly;
the browser then adds an ``Origin`` header, and any origin not allowed gets
403 at the server — not merely a response the page cannot read.

Not every such request carries an Origin: an ``<img>`` or ``<script>`` tag, or
``fetch(…, {mode: "no-cors"})`` with GET, sends none. Browsers mark them with
``Sec-Fetch-Site`` instead, so a request marked ``cross-site`` or ``same-site``
(a page on another port of this computer) is refused unless it carries an Origin
that is allowed — except a top-level navigation to the dashboard
(``Sec-Fetch-Mode: navigate``, ``Sec-Fetch-Dest: document``), which is how the
tray's launch page opens it. ``same-origin`` (our own pages) and ``none`` (typed,
bookmarked, or not a browser) pass. Older browsers send no Sec-Fetch-*: their
Origin-less GETs still pass here, but one that is a 404 or 405 (such as a GET of
/v1/classify) costs no rate-limit token.

IPv6 literals are parsed properly (``[::1]:8765``), unlike Starlette's
``TrustedHostMiddleware``.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from app.config import LOOPBACK_HOSTS
from app.errors import ApiError
from app.gates import refuse
from app.http.stats import RequestStats

OTHER_SITES = frozenset({"cross-site", "same-site"})
DASHBOARD = "/ui"
_READ = (b"host", b"origin", b"sec-fetch-site", b"sec-fetch-mode", b"sec-fetch-dest")


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
        # (name, port) per allowed_hosts entry, port None for any; a bare IPv6 address
        # (no brackets) is a name alone. Loopback names stay tied to our own port even
        # when listed: other local web servers' pages must not pass as ours.
        entries = (split_host(h) or (h.strip().lower(), None) for h in extra_hosts)
        self.public = {entry for entry in entries if entry[0] not in LOOPBACK_HOSTS}
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}

    def is_public(self, host: tuple[str, int | None]) -> bool:
        """A name in ``allowed_hosts``: with any port, or only the one an entry names
        ("vision.example.com:8443"). Behind a reverse proxy or Ray Serve's proxy the Host
        is the public name with the proxy's port, not ours; only that name's own DNS can
        send a browser to it, so rebinding gains nothing from the port."""
        return (host[0], None) in self.public or host in self.public

    def public_origin(self, host: tuple[str, int | None]) -> bool:
        """A page under a public name that is ours: on the port its entry names, or, for
        an entry without one, on our own port or the scheme's default (a TLS proxy's
        443). Another port of that machine is another web service, not us."""
        name, port = host
        return host in self.public or ((name, None) in self.public
                                       and port in (None, self.port))

    def loopback(self, host: tuple[str, int | None]) -> bool:
        """A loopback name with our own port."""
        name, port = host
        return name in LOOPBACK_HOSTS and port in (self.port, None if self.port == 80 else -1)

    def host_allowed(self, header: str | None) -> bool:
        """A public name (``is_public``), or a loopback name with our own port."""
        parsed = split_host(header or "")
        return parsed is not None and (self.is_public(parsed) or self.loopback(parsed))

    def origin_allowed(self, origin: str) -> bool:
        origin = origin.rstrip("/").lower()
        if origin in self.origins:
            return True
        parts = urlsplit(origin)
        host = split_host(parts.netloc) if parts.scheme in ("http", "https") else None
        if host is None:
            return False
        if parts.scheme == "http" and self.loopback(host):
            return True  # our own pages (/docs) are same-origin
        return self.public_origin(host)  # ... also through a TLS proxy

    @staticmethod
    def opens_the_dashboard(scope: Scope, headers: dict[bytes, str]) -> bool:
        """A link followed to /ui in the browser's own window (not a frame, image or
        script): the only request another site may make."""
        return (scope["method"] == "GET" and scope["path"] == DASHBOARD
                and headers.get(b"sec-fetch-mode", "").lower() == "navigate"
                and headers.get(b"sec-fetch-dest", "").lower() == "document")

    def from_another_site(self, scope: Scope, headers: dict[bytes, str]) -> bool:
        """Marked by the browser as sent by another site (or another port), without an
        allowed Origin, and not a navigation to the dashboard."""
        if headers.get(b"sec-fetch-site", "").strip().lower() not in OTHER_SITES:
            return False
        if b"origin" in headers and self.origin_allowed(headers[b"origin"]):
            return False
        return not self.opens_the_dashboard(scope, headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name: value.decode("latin-1") for name, value in scope["headers"]
                   if name in _READ}
        if not self.host_allowed(headers.get(b"host")):
            error = Forbidden("This address is not allowed. Use http://127.0.0.1:"
                              f"{self.port} or http://localhost:{self.port}.")
        elif self.from_another_site(scope, headers):
            error = Forbidden("Requests from other web pages are not allowed unless their "
                              "origin is listed in the cors_origins setting.")
        elif b"origin" in headers and not self.origin_allowed(headers[b"origin"]):
            error = Forbidden("Requests from web pages are not allowed unless their origin "
                              "is listed in the cors_origins setting.")
        else:
            await self.app(scope, receive, send)
            return
        await refuse(error, self.stats, scope, receive, send)
