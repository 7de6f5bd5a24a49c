"""Where a program on this computer reaches a server that listens on ``host``: the one
address that server really listens on, never a neighbour of it.

A server on ``::1`` is not on ``127.0.0.1``: another user may listen there and relay
(issue 26). So the loopback names and wildcards map to the loopback address of the family
the server binds (uvicorn binds IPv6 exactly when the host has a colon): ``""``,
``0.0.0.0``, ``localhost`` and ``127.0.0.1`` → ``127.0.0.1``; ``::`` and ``::1`` →
``::1``. Any other host is reached as written. The instance file, the tray,
``vramguard stop``, the use page and the clients all take their address from here (the
torch-free clients repeat the rule, tested against this one).
"""

from __future__ import annotations

IPV4_LOOPBACK = "127.0.0.1"
IPV6_LOOPBACK = "::1"
_TO_IPV4 = frozenset({"", "0.0.0.0", "localhost", IPV4_LOOPBACK})
_TO_IPV6 = frozenset({"::", IPV6_LOOPBACK})


def reached_host(host: str) -> str:
    """The address a local client connects to for a server listening on ``host``."""
    name = host.strip().strip("[]").lower()
    if name in _TO_IPV4:
        return IPV4_LOOPBACK
    if name in _TO_IPV6:
        return IPV6_LOOPBACK
    return name


def netloc(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 address."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def local_url(host: str, port: int) -> str:
    """``http://`` URL of a server listening on ``host`` and ``port``, as a local client
    reaches it."""
    return f"http://{netloc(reached_host(host), port)}"
