"""Where the appliance listens and where its admin token is, found the way vramguard
itself decides them (without importing it):

1. the instance files of a running vramguard (``run/instance-<port>.json`` beside the
   admin token file, valid only while the server holds ``instance-<port>.lock``);
2. the settings: ``VRAMGUARD_PORT`` / ``VRAMGUARD_HOST``, else ``port`` / ``host`` in the
   config file (``VRAMGUARD_CONFIG``, else ``config.toml`` in the per-user config folder);
3. the default, ``http://127.0.0.1:8765``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

if sys.version_info >= (3, 11):  # noqa: UP036 (the client supports 3.10; the repo lints for 3.11)
    import tomllib
else:
    import tomli as tomllib

if sys.platform == "win32":
    import msvcrt
else:
    import fcntl

APP_NAME = "vramguard"
ENV_PREFIX = "VRAMGUARD_"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
_TO_IPV4 = frozenset({"127.0.0.1", "localhost", "0.0.0.0", ""})
_TO_IPV6 = frozenset({"::1", "::"})
"""Host settings reached at the loopback address of the family the server binds (IPv6
exactly when the host has a colon): a server on ``::1`` is not on ``127.0.0.1``, where
another program may listen (vramguard's own rule: ``app/host/address.py``)."""
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass(frozen=True)
class ServerLocation:
    """Where the appliance is (``url``), how that was found (``source``: ``argument``,
    ``instance``, ``config`` or ``default``), and its admin token file."""

    url: str
    source: str
    token_file: Path

    @property
    def local(self) -> bool:
        """Whether the appliance is on this computer (a loopback address, or found in a
        running vramguard's instance file): then no proxy of the environment, or of
        Windows' settings, is ever used to reach it (httpx ignores the system's exception
        list, encode/httpx#1536, and a proxy cannot reach this computer's loopback)."""
        return self.source in ("instance", "default") or is_loopback(urlsplit(self.url).hostname)


def config_folder() -> Path:
    """vramguard's per-user config folder (what ``platformdirs.user_config_dir`` says)."""
    if sys.platform == "win32":
        local = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
        return Path(local) / APP_NAME
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / APP_NAME
    xdg = os.environ.get("XDG_CONFIG_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".config") / APP_NAME


def _config_file() -> dict[str, Any]:
    """The config file's settings; {} when there is none or it cannot be read (a server
    would not start with an unreadable one)."""
    named = os.environ.get(f"{ENV_PREFIX}CONFIG")
    path = Path(named) if named else config_folder() / "config.toml"
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _setting(name: str, config: dict[str, Any]) -> Any:
    """A setting from the environment, else the config file; None when neither has it."""
    return os.environ.get(ENV_PREFIX + name.upper()) or config.get(name)


def _port(value: Any) -> int | None:
    try:
        port = int(value)
    except (TypeError, ValueError):
        return None
    return port if 0 < port < 65536 else None


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` names this computer's loopback (``localhost``, 127.0.0.0/8, ``::1``)."""
    name = (host or "").strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def url_for(host: str, port: int) -> str:
    """The address a client on this computer uses for a server listening on ``host``."""
    name = host.strip().strip("[]").lower()
    name = DEFAULT_HOST if name in _TO_IPV4 else "::1" if name in _TO_IPV6 else name
    return f"http://[{name}]:{port}" if ":" in name else f"http://{name}:{port}"


def _is_ours(folder: Path) -> bool:
    """Whether ``folder`` is a real folder of this user (vramguard keeps it private)."""
    try:
        info = os.lstat(folder)
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode):
        return False
    return sys.platform == "win32" or info.st_uid == os.geteuid()


def _try_lock(fd: int) -> bool:
    try:
        if sys.platform == "win32":
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        else:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _unlock(fd: int) -> None:
    with contextlib.suppress(OSError):
        if sys.platform == "win32":
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)


def _held(lock_file: Path) -> bool:
    """Whether a live server holds this lock (probed by taking it for a moment, as
    vramguard's own second launch does; a crashed server's lock is free)."""
    try:
        fd = os.open(lock_file, os.O_RDWR | _NO_FOLLOW)
    except OSError:
        return False
    try:
        if not _try_lock(fd):
            return True
        _unlock(fd)
        return False
    finally:
        os.close(fd)


def _described_host(info_file: Path) -> str:
    """The host in the URL the server wrote about itself (the loopback address when the
    description is missing, a link, or not vramguard's)."""
    try:
        fd = os.open(info_file, os.O_RDONLY | _NO_FOLLOW)
        with os.fdopen(fd, encoding="utf-8") as handle:
            url = json.load(handle).get("url")
        parts = urlsplit(str(url))
        if parts.scheme == "http" and parts.hostname:
            return parts.hostname
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    return DEFAULT_HOST


def running_servers(token_file: Path) -> dict[int, str]:
    """Port → URL of every vramguard of this user running with this token file."""
    folder = token_file.parent / "run"
    if not _is_ours(folder):
        return {}
    found = {}
    for lock_file in folder.glob("instance-*.lock"):
        port = _port(lock_file.stem.removeprefix("instance-"))
        if port is not None and _held(lock_file):
            found[port] = url_for(_described_host(folder / f"instance-{port}.json"), port)
    return dict(sorted(found.items()))


def find_server(url: str | None = None,
                token_file: str | os.PathLike[str] | None = None) -> ServerLocation:
    """Where the appliance is: ``url`` when given, else a running vramguard's instance
    file (the one on the configured port first), else the configured host and port, else
    the default. The admin token file: ``token_file``, else ``VRAMGUARD_TOKEN_FILE``, else
    the config file's ``token_file``, else ``admin-token`` in the config folder."""
    config = _config_file()
    named = token_file or _setting("token_file", config)
    tokens = Path(named) if named else config_folder() / "admin-token"
    if url:
        return ServerLocation(url.rstrip("/"), "argument", tokens)
    host, port = _setting("host", config), _port(_setting("port", config))
    configured = port or DEFAULT_PORT
    running = running_servers(tokens)
    if running:
        chosen = configured if configured in running else next(iter(running))
        return ServerLocation(running[chosen], "instance", tokens)
    source = "config" if host or port else "default"
    return ServerLocation(url_for(str(host or DEFAULT_HOST), configured), source, tokens)
