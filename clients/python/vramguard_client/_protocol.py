"""What the sync and async clients share: images to bytes, answers to errors, the retry
rules, and the identity challenge before the admin token is sent."""

from __future__ import annotations

import email.utils
import hashlib
import hmac
import io
import ipaddress
import json
import os
import random
import re
import secrets
import stat
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, cast
from urllib.parse import quote

import httpx

from vramguard_client._errors import (
    ConnectionLost,
    NotRunning,
    NotVramguard,
    RateLimited,
    Timeout,
    Unauthorized,
    UnexpectedResponse,
    VramguardError,
    error_for,
)
from vramguard_client._version import __version__

if TYPE_CHECKING:
    from PIL.Image import Image

ImageInput: TypeAlias = "str | os.PathLike[str] | bytes | bytearray | memoryview | Image"
"""A file path, the file's bytes, or a PIL image (sent as PNG, lossless)."""

RETRIED = frozenset({"rate_limited", "overloaded", "deadline_exceeded", "not_ready",
                     "loading", "insufficient_memory", "connection_lost", "replica_lost"})
"""Codes worth another try; every other error (4xx, paused, ...) is raised at once.
(``replica_lost``: a cluster replica died with the request; another one answers it.
``loading``: the model asked for is being loaded; it holds back only that request.)"""
PACED = frozenset({"rate_limited", "overloaded", "not_ready"})
"""Codes that hold back every image request of this client, not only the refused one:
the server refused this client, or is refusing everyone."""
JITTER = 0.25  # a wait grows by up to this share (never shrinks): clients spread out
BACKOFF_S = 0.5  # without Retry-After: 0.5, 1, 2, 4, 8 s
BACKOFF_MAX_S = 8.0
NONCE_BYTES = 32
PNG_MODES = frozenset({"1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"})
OCTETS = {"Content-Type": "application/octet-stream"}  # the server reads the format itself
JSON = {"Content-Type": "application/json"}
CLIENT_ID = re.compile(r"[A-Za-z0-9._-]{1,64}", re.ASCII)  # what X-Client-Id may be

Progress = Callable[[int, int | None], object]
"""``on_progress(done, total)``: images finished so far, and how many there are (None
when the input has no length)."""


def headers_for(client_id: str | None) -> dict[str, str]:
    """Headers of every request: who we are, and the rate-limit bucket we ask for."""
    headers = {"User-Agent": f"vramguard-client/{__version__}"}
    if client_id is not None:
        if not CLIENT_ID.fullmatch(client_id):
            raise ValueError("client_id is 1 to 64 letters, digits, '.', '_' or '-' (the "
                             f"server would ignore {client_id!r})")
        headers["X-Client-Id"] = client_id
    return headers


def image_params(top_k: int | None, model: str | None, keep_alive: float | None,
                 threshold: float | None = None) -> dict[str, Any]:
    """The query of an image request: only what the caller gave (the server's defaults
    for the rest)."""
    params = {"top_k": top_k, "model": model, "keep_alive": keep_alive,
              "threshold": threshold}
    return {key: value for key, value in params.items() if value is not None}


def image_bytes(image: ImageInput) -> bytes:
    """What is uploaded for ``image``: a file's bytes as they are; a PIL image as PNG."""
    if isinstance(image, bytes | bytearray | memoryview):
        return bytes(image)
    if isinstance(image, str | os.PathLike):
        return Path(image).read_bytes()
    pil = sys.modules.get("PIL.Image")  # a PIL image exists only if PIL is imported
    if pil is not None and isinstance(image, pil.Image):
        picture = cast("Image", image)
        if picture.mode not in PNG_MODES:
            picture = picture.convert("RGB")
        out = io.BytesIO()
        picture.save(out, "PNG", compress_level=1)
        return out.getvalue()
    raise TypeError(f"an image is a path, bytes or a PIL image, not {type(image).__name__}")


def retry_after(response: httpx.Response) -> float | None:
    """Seconds the server asked to wait: ``Retry-After`` (seconds or an HTTP date), else
    for a 429 with no token left ``RateLimit-Reset``."""
    value = response.headers.get("retry-after")
    if value is None and response.status_code == 429 and \
            response.headers.get("ratelimit-remaining") == "0":
        value = response.headers.get("ratelimit-reset")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def error_from(response: httpx.Response) -> VramguardError:
    """The exception for an error answer (``{"error": {"code", "message"}}``)."""
    wait = retry_after(response)
    try:
        error = response.json()["error"]
        code, message = str(error["code"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        text = response.text[:200] or response.reason_phrase
        if response.status_code == 429:
            return RateLimited(text, retry_after=wait)
        return UnexpectedResponse(f"HTTP {response.status_code}: {text}",
                                  status=response.status_code, retry_after=wait)
    return error_for(code, response.status_code, message, wait)


def transport_error(exc: httpx.TransportError, url: str) -> VramguardError:
    if isinstance(exc, httpx.ConnectError):
        return NotRunning(f"Nothing answers at {url}: is vramguard running? ({exc})")
    if isinstance(exc, httpx.TimeoutException):
        return Timeout(f"No answer from {url} within the call's timeout.")
    return ConnectionLost(f"The connection to {url} broke: {exc}")


def json_body(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise UnexpectedResponse(f"not vramguard's answer: {response.text[:200]!r}",
                                 status=response.status_code)
    return body


class Pace:
    """A client-wide "not before": after a 429 or an overloaded 503 none of this client's
    image requests goes out until the server's wait is over (shared by its threads or
    tasks, so concurrent requests do not retry into the refusal together)."""

    def __init__(self) -> None:
        self._until = 0.0
        self._lock = threading.Lock()

    def hold(self, seconds: float) -> None:
        with self._lock:
            self._until = max(self._until, time.monotonic() + seconds)

    def wait_s(self) -> float:
        """How long to wait before sending, jittered (never less than the hold)."""
        left = self._until - time.monotonic()
        return left + random.uniform(0, JITTER * left) if left > 0 else 0.0


class Call:
    """One call's retry rules: an overall deadline, at most ``max_retries`` more tries,
    and waits of at least what the server asked (``Retry-After``), plus jitter."""

    def __init__(self, timeout: float, max_retries: int, pace: Pace | None) -> None:
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.max_retries = max_retries
        self.pace = pace
        self.tries = 0
        self.may_follow = True  # to a found appliance that moved (once; never with a token)

    def _left(self) -> float:
        return self.deadline - time.monotonic()

    def before_try(self) -> float:
        """Seconds to wait before the next try (a hold the server put on this client);
        Timeout when that would pass the deadline."""
        wait = self.pace.wait_s() if self.pace is not None else 0.0
        if wait >= self._left():
            raise Timeout(f"vramguard asked this client to wait {wait:.1f} s, longer than "
                          f"what is left of this call's {self.timeout:g} s timeout.")
        return wait

    def try_timeout(self) -> float:
        """The time one try may take: what is left of the call's."""
        left = self._left()
        if left <= 0:
            raise Timeout(f"No answer within the call's {self.timeout:g} s timeout.")
        self.tries += 1
        return left

    def after_failure(self, error: VramguardError) -> float:
        """Seconds to wait before trying again after ``error``; raises it when it is not
        worth another try, or when the wait would pass the deadline."""
        if error.code not in RETRIED or self.tries > self.max_retries:
            raise error
        asked = error.retry_after
        base = asked if asked is not None else \
            min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (self.tries - 1))
        wait = base + random.uniform(0, JITTER * max(base, BACKOFF_S))
        if wait >= self._left():
            raise error
        if self.pace is not None and error.code in PACED:
            self.pace.hold(wait)
        return wait


def read_token(path: Path) -> str:
    """The admin token from its file; Unauthorized when there is none or the file is not
    private (as vramguard itself refuses it)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    except OSError as exc:
        raise Unauthorized(f"Cannot read the admin token file {path} ({exc.strerror}). "
                           "vramguard writes it at its first start; admin calls need it "
                           "(set token_file or VRAMGUARD_TOKEN_FILE if it is elsewhere).") \
            from None
    with os.fdopen(fd, "rb") as handle:
        mode = os.fstat(handle.fileno()).st_mode
        token = handle.read().decode("utf-8", errors="replace").strip()
    if sys.platform != "win32" and mode & 0o077:
        raise Unauthorized(f"The admin token file {path} can be read or changed by other "
                           f"users (permissions {stat.filemode(mode)[1:]}); make it "
                           f"private: chmod 600 {path}")
    if not token:
        raise Unauthorized(f"The admin token file {path} is empty.")
    return token


NO_IMAGE_SENT = "no image was sent to it"


def image_token(path: Path, url: str) -> str:
    """The admin token, for checking a found appliance before images go to it; when it
    cannot be read, NotVramguard saying how to send them anyway (name the server)."""
    try:
        return read_token(path)
    except Unauthorized as exc:
        raise NotVramguard(f"{exc} Without it the program answering at {url} cannot be "
                           f"checked to be your vramguard, so {NO_IMAGE_SENT}. To send "
                           "images there without the check, give its URL yourself.") \
            from None


def new_challenge() -> tuple[bytes, bytes]:
    """A fresh nonce and the ``POST /v1/identity`` body that carries it."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce, json.dumps({"nonce": nonce.hex()}).encode()


def answered_at(answer: httpx.Response) -> tuple[str, int]:
    """The address and port that really answered: the connection's peer (an IP address,
    whatever name the URL gave), else the URL's host and port (a test transport)."""
    stream = answer.extensions.get("network_stream")
    peer = None
    if stream is not None:
        try:
            peer = stream.get_extra_info("server_addr")
        except OSError:  # the connection has closed since
            peer = None
    if isinstance(peer, tuple) and len(peer) >= 2:
        return str(peer[0]), int(peer[1])
    origin = answer.url
    return origin.host, origin.port or (443 if origin.scheme == "https" else 80)


def proof_address(host: str) -> bytes:
    """An address as the server binds it into the proof: an IP address's 4 or 16 bytes
    (``::ffff:a.b.c.d`` as its IPv4 4), else the name's lower-case UTF-8."""
    name = host.strip("[]")
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return name.lower().encode()
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.packed


def expected_proof(token: str, nonce: bytes, host: str, port: int) -> str:
    """HMAC-SHA256(token, nonce ‖ one length byte ‖ address ‖ port as 2 big-endian
    bytes): what a vramguard listening at ``host`` and ``port`` answers."""
    address = proof_address(host)
    message = nonce + len(address).to_bytes(1, "big") + address + port.to_bytes(2, "big")
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def proven_origin(answer: httpx.Response | None, token: str, nonce: bytes,
                  url: str, withheld: str = "the admin token was not sent") -> str:
    """The origin (``scheme://host:port``) that answered the challenge, when its answer
    is the proof for the address and port this client's connection really reached: it
    knows this user's token and listens exactly there (not a program on the other
    loopback address or another port that relays the challenge). Else NotVramguard,
    saying what was ``withheld`` (``answer`` None: it answered, but not to the
    challenge)."""
    if answer is not None:
        expected = expected_proof(token, nonce, *answered_at(answer))
        try:
            proof = answer.json().get("proof")
        except (ValueError, AttributeError):
            proof = None
        if isinstance(proof, str) and hmac.compare_digest(proof.encode(), expected.encode()):
            origin = answer.url
            return f"{origin.scheme}://{origin.netloc.decode('ascii')}"
    raise NotVramguard(f"The program answering at {url} cannot prove it is your vramguard "
                       f"(or it uses another admin-token file); {withheld}.")


def model_path(name: str, action: str) -> str:
    """``/v1/models/{name}/{action}`` with the name quoted as one path part."""
    return f"/v1/models/{quote(name, safe='')}/{action}"
