"""The admin token's file and the identity proof: a per-user secret that admin endpoints
require as a Bearer token (``app/gates/admin_token.py`` checks it).

Created at first start in the per-user config folder with owner-only
permissions; the tray reads it from there, and refuses a file that other users could
read. Web pages cannot read files, so a page in the user's browser cannot call admin
endpoints. Before the tray hands the token to whatever answers on the port, the
server proves it knows the token (``identity_proof``): another program holding the port
gets nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import shlex
import stat
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("vramguard.gates")  # the logger name users already filter on
NONCE_BYTES = 32


class InsecureTokenFile(OSError):
    """The token file is not private (other users could read or change it): refused, with
    the message saying how to fix it."""


def proof_address(host: str) -> bytes:
    """An address as the proof binds it: an IP address's 4 or 16 bytes (an IPv4 address
    seen through a dual-stack socket, ``::ffff:a.b.c.d``, as its 4), else the name's
    lower-case UTF-8 (a test transport's made-up host)."""
    name = host.strip("[]")
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return name.lower().encode()
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.packed


def identity_proof(token: str, nonce: bytes, host: str, port: int) -> str:
    """HMAC-SHA256 keyed with the token over the nonce, the address the server received
    the challenge on (one length byte, then ``proof_address``) and that port (two bytes,
    big-endian), in hex. Binding the address and the port means a program that passes the
    challenge on to a real vramguard cannot use its answer as its own: the answer names
    where the real server listens (another port, or ``::1`` where the relay holds
    ``127.0.0.1``), and the client checks it against where it connected."""
    address = proof_address(host)
    message = nonce + len(address).to_bytes(1, "big") + address + port.to_bytes(2, "big")
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def user_profile() -> Path:
    """The user's own folder, where Windows keeps private files (``token_file_problem``)."""
    return Path(os.environ.get("USERPROFILE") or Path.home())


def token_file_problem(path: Path, mode: int, *, windows: bool, profile: Path,
                       name: str = "admin token file",
                       or_else: str = "or remove the token_file setting to use the default"
                       ) -> str | None:
    """Why a token file is not private, or None. POSIX: any permission for the group or
    others. Windows has no mode bits worth reading: the file must lie in the user's own
    profile folder, whose access list only the user and the system share. ``name`` and
    ``or_else`` (the fix besides moving it) word the message for another secret's file."""
    if windows:
        if path.resolve().is_relative_to(profile.resolve()):
            return None
        return (f"The {name} {path} is outside your own user folder ({profile}), "
                "where other users of this computer may be able to read it. Move it into "
                f"your user folder, {or_else}.")
    if mode & 0o077:
        return (f"The {name} {path} can be read or changed by other users of "
                f"this computer (its permissions are {stat.filemode(mode)[1:]}). Make it "
                f"private with: chmod 600 {shlex.quote(str(path))}")
    return None


def load_or_create_token(path: Path) -> str:
    """Read the token, creating it (mode 0600) on first use or when the file is empty;
    InsecureTokenFile when others may read it."""
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
    """The token the file holds ('' when there is none); the permissions are those of the
    file actually read (fstat), so a swap between check and read changes nothing."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        return ""
    with os.fdopen(fd, "rb") as handle:
        mode = os.fstat(handle.fileno()).st_mode
        token = handle.read().decode("utf-8", errors="replace").strip()
    problem = token and token_file_problem(path, mode, windows=sys.platform == "win32",
                                           profile=user_profile())
    if problem:
        raise InsecureTokenFile(problem)
    return token


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
            except OSError as exc:
                log.warning("cannot use the admin token file %s (%s); keeping the token "
                            "vramguard started with", self.path, exc)
            self._seen = self._identity()
        return self._token
