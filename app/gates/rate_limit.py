"""In-process token buckets: one per client and route family, plus one global bucket
per family.

A client is its peer address plus an optional ``X-Client-Id`` header (desktop
apps on the same machine share 127.0.0.1, so they may name themselves). A
denied request gets 429 with ``Retry-After`` (seconds until one token, rounded
up) and the ``RateLimit-*`` headers.

Only a request for a route that exists, with its method, is charged: a 404 or 405
costs nothing. (A web page's ``<img src=".../v1/classify">`` is a GET without an
Origin header; when it cost a classify token, a page could drain the bucket that
every local app without ``X-Client-Id`` shares.)

A caller that sends the admin token (or a dashboard session) is recognised before
anything is charged: its requests use buckets of their own, whatever ``X-Client-Id``
it claims, and skip the global read and admin buckets. So no program without the
token can spend the tray's tokens or starve it through the global buckets.
``/healthz`` and ``/readyz`` (and ``/v2/health/*``) skip the global buckets too: a
supervisor's health check must not fail because others are busy; so does ``/v1/events``,
whose cost is bounded by its stream slots, so that the tray's live line (which carries
no token) cannot be starved by others' reads. The two handshakes made before a caller
can authenticate, ``/v1/identity`` (the tray checks the server before it sends the
token) and ``/v1/ui/session`` (the dashboard trades its one-time code), are not charged
at all: any bucket they shared could be emptied by a program without the token, and
each costs less than a 404. (Guessing is hopeless: a code is 192 random bits and lives
two minutes.)

Decision: a rejected request costs no token. Otherwise a client that keeps
retrying too early would starve itself for ever; with this rule, honouring
``Retry-After`` always works.

An image stream (``STREAM_ROUTES``: many images in one request) and a ``/v2`` infer
request (``OIP_INFER``: up to 64) cost what the same images sent one by one would: one
classify token per image. The request's own token pays for its first image; the route
takes one more (``TOKEN_KEY`` in the scope) for each further image, the stream as it
starts to read it, ``/v2`` once its body says how many (``take_tokens``), and when none
is left it waits for the next one instead of failing: the request slows to the client's
rate, and those waits are not counted as refusals. A ``/v2`` request whose tokens would
not all come before its deadline gets 429 then, with the seconds until the next token
(those it took are spent, as images a stream sent before it failed): it is not served
past the client's rate, and one that fits the rate is never refused for its size.

Memory is bounded: buckets of clients idle long enough to be full again are
dropped, and at most ``max_clients`` are kept (the least recently seen go).
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import RateLimited
from app.gates import refuse
from app.http.scope import (
    ADMIN_CALLER,
    HANDSHAKES,
    NOT_GLOBAL,
    OIP_INFER,
    STREAM_ROUTES,
    TOKEN_KEY,
    authorization,
    client_key,
    route_exists,
    route_family,
)
from app.http.stats import RequestStats

_EPSILON = 1e-9  # float refill arithmetic must not deny a token that is due


@dataclass(frozen=True)
class Rate:
    """``burst`` tokens at most, refilled at ``per_second``."""

    burst: int
    per_second: float


class TokenBucket:
    def __init__(self, rate: Rate, now: float) -> None:
        self.rate = rate
        self.tokens = float(rate.burst)
        self.updated = now

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.updated)
        self.tokens = min(self.rate.burst, self.tokens + elapsed * self.rate.per_second)
        self.updated = now

    def try_take(self, now: float) -> bool:
        self._refill(now)
        if self.tokens >= 1 - _EPSILON:
            self.tokens = max(0.0, self.tokens - 1)
            return True
        return False

    def seconds_until_token(self, now: float) -> float:
        self._refill(now)
        if self.tokens >= 1 - _EPSILON:
            return 0.0
        return (1 - self.tokens) / self.rate.per_second

    def seconds_until_full(self, now: float) -> float:
        self._refill(now)
        return (self.rate.burst - self.tokens) / self.rate.per_second

    def remaining(self) -> int:
        return int(self.tokens)


@dataclass(frozen=True)
class Decision:
    allowed: bool
    limit: int
    remaining: int
    reset: float
    retry_after: float = 0.0


class Limiter(Protocol):
    """What the HTTP layer asks of a rate limiter, in-process or shared (Redis, in
    app/cluster/redis_limiter.py): it never knows which one it has."""

    @property
    def rejected(self) -> int:
        """Refusals counted so far (the metrics' rate-limited total)."""

    @property
    def fallback(self) -> bool:
        """Whether a shared limiter is working from its local share (its store cannot be
        reached); never for the in-process one."""

    async def acquire(self, family: str, client: str, *, shared: bool = True,
                      counted: bool = True) -> Decision:
        """Take a token for ``client`` in ``family`` (and the family's global one with
        ``shared``), or say how long to wait."""


class RateLimiter:
    """Buckets per (family, client) and one global bucket per family; thread-safe.

    ``check`` is synchronous: the appliance's buckets live in this process, so taking a
    token never waits; ``acquire`` is the same call behind the ``Limiter`` interface."""

    def __init__(self, per_client: dict[str, Rate], global_rates: dict[str, Rate],
                 clock: Callable[[], float] = time.monotonic, max_clients: int = 4096) -> None:
        self.per_client = per_client
        self.global_rates = global_rates
        self.clock = clock
        self.max_clients = max_clients
        self._clients: OrderedDict[tuple[str, str], TokenBucket] = OrderedDict()
        self._globals = {family: TokenBucket(rate, clock()) for family, rate in
                         global_rates.items()}
        self._lock = threading.Lock()
        self.rejected = 0

    def check(self, family: str, client: str, *, shared: bool = True,
              counted: bool = True) -> Decision:
        """Take a token from the client's bucket and (with ``shared``) the family's global
        one, or say how long to wait (a refusal ``counted`` in ``rejected``)."""
        rate = self.per_client.get(family)
        if rate is None:
            return Decision(True, 0, 0, 0.0)
        with self._lock:
            now = self.clock()
            bucket = self._clients.pop((family, client), None) or TokenBucket(rate, now)
            self._clients[(family, client)] = bucket
            self._expire(now)
            common = self._globals.get(family) if shared else None
            blocked = [b for b in (bucket, common) if b is not None and b.seconds_until_token(now)]
            if blocked:
                if counted:
                    self.rejected += 1
                wait = max(b.seconds_until_token(now) for b in blocked)
                return Decision(False, rate.burst, 0, bucket.seconds_until_full(now), wait)
            bucket.try_take(now)
            if common is not None:
                common.try_take(now)
            return Decision(True, rate.burst, bucket.remaining(), bucket.seconds_until_full(now))

    async def acquire(self, family: str, client: str, *, shared: bool = True,
                      counted: bool = True) -> Decision:
        return self.check(family, client, shared=shared, counted=counted)

    @property
    def fallback(self) -> bool:
        return False

    def _expire(self, now: float) -> None:
        """Drop buckets that have refilled completely (they hold no state worth keeping),
        oldest first, and any beyond ``max_clients``; never the one just used."""
        while len(self._clients) > 1:
            key, oldest = next(iter(self._clients.items()))
            if len(self._clients) <= self.max_clients and oldest.seconds_until_full(now) > 0:
                return
            del self._clients[key]

    def __len__(self) -> int:
        return len(self._clients)


async def _free() -> Decision:
    """What a request that is not charged gets: no limit, no headers."""
    return Decision(True, 0, 0, 0.0)


class RateLimitMiddleware:
    """ASGI middleware: 429 before anything else is done for a request over its rate; each
    refusal is counted in ``stats``. ``is_admin`` says whether an Authorization header
    holds the admin token or a dashboard session."""

    def __init__(self, app: ASGIApp, limiter: Limiter, stats: RequestStats,
                 is_admin: Callable[[str], bool]) -> None:
        self.app = app
        self.limiter = limiter
        self.stats = stats
        self.is_admin = is_admin

    def charge(self, scope: Scope, *, counted: bool = True) -> Awaitable[Decision]:
        """Take this request's token from its client's bucket for its family, and from
        the family's global bucket unless it is exempt; nothing for a handshake or a route
        that does not exist. ``counted``: a refusal counts as a rate-limited request."""
        path = scope["path"]
        if path in HANDSHAKES or not route_exists(scope):
            return _free()
        family = route_family(scope["method"], path)
        client = client_key(scope)
        header = authorization(scope)
        if header and self.is_admin(header):
            return self.limiter.acquire(family, client + ADMIN_CALLER,
                                        shared=family == "classify", counted=counted)
        return self.limiter.acquire(family, client, shared=path not in NOT_GLOBAL,
                                    counted=counted)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        decision = await self.charge(scope)
        if not decision.allowed:
            error = RateLimited("Too many requests. Wait for the number of seconds in "
                                "Retry-After, then send again.",
                                retry_after=decision.retry_after, limit=decision.limit,
                                reset=decision.reset)
            await refuse(error, self.stats, scope, receive, send)
            return
        if not decision.limit:
            await self.app(scope, receive, send)
            return
        if scope["path"] in STREAM_ROUTES or OIP_INFER.match(scope["path"]):
            scope[TOKEN_KEY] = functools.partial(self.charge, scope, counted=False)

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"],
                                      (b"ratelimit-limit", str(decision.limit).encode()),
                                      (b"ratelimit-remaining", str(decision.remaining).encode()),
                                      (b"ratelimit-reset", str(math.ceil(decision.reset)).encode())]
            await send(message)

        await self.app(scope, receive, with_headers)


async def take_tokens(scope: Scope, count: int, deadline: float,
                      clock: Callable[[], float] = time.monotonic) -> None:
    """``count`` more classify tokens for the request in ``scope`` (its own paid for its
    first image), each waited for while it is due before ``deadline``; RateLimited (429)
    at once when the next is not. Nothing to take when the request is not rate-limited."""
    take: Callable[[], Awaitable[Decision]] | None = scope.get(TOKEN_KEY)
    if take is None:
        return
    for taken in range(count):
        while not (decision := await take()).allowed:
            if clock() + decision.retry_after > deadline:
                raise RateLimited(
                    f"This request holds {count + 1} images, and each costs one request of "
                    f"this app's rate limit, as if sent one by one: the last {count - taken} "
                    "would go past its rate before the request's deadline. Send fewer images "
                    "per request, or send again after the seconds in Retry-After.",
                    retry_after=decision.retry_after, limit=decision.limit,
                    reset=decision.reset)
            await asyncio.sleep(decision.retry_after)
