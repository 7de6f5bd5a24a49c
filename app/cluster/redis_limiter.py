"""Token buckets shared by all replicas through Redis, behind the same ``Limiter``
interface as the in-process ones (app/gates/rate_limit.py): same rates, same rules, same
headers, so the HTTP layer does not know which one it has.

One Lua script (token_bucket.lua), loaded once and then called by its SHA, refills, takes
and computes the waits of a client's bucket and of its family's global bucket in one
atomic round trip, on Redis's clock: two replicas cannot both take the last token, which
the common read-then-write version (HGETALL, then HSET) allows.

Keys are ``PREFIX:rl:{FAMILY}:c:CLIENT`` (a client's bucket) and ``PREFIX:rl:{FAMILY}:g``
(the family's global one). The braces are literal: a Redis Cluster hash tag, so that both
keys of one call live in one slot. This module talks to one Redis server (a primary,
with replicas or Sentinel behind one address if wanted), not to a Redis Cluster; the tag
only keeps that move open. The client part comes after its own ``c:`` segment, so no
client string can name the global key or another family's bucket. Each key expires once
its bucket would be full again (plus a second): an idle client costs no memory, and a
missing key reads as a full bucket.

When Redis cannot be reached (refused, timed out after ``redis_timeout_s``, 0.25 s by
default, still loading), each replica falls back to an in-process bucket with its share
of every limit (the rate and burst divided by ``replicas``, a burst of at least 1):
fail-open to a local limit, not fail-closed, because refusing every request while the
limiter's store is away would turn a Redis outage into an outage of the whole service,
while the local share keeps the total close to the configured limit. One warning is
logged; while falling back, Redis is tried again by one request about once a second, and
one info line says when it is back.
A Redis that answers the script with an error (a key of another type, out of memory, no
permission) falls back the same way, but is logged as an error: it will not heal itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from importlib.resources import files
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app.config import Settings
from app.gates.rate_limit import Decision, Rate, RateLimiter
from app.http.server import limit_rates

log = logging.getLogger("vramguard.cluster")
SCRIPT = files("app.cluster").joinpath("token_bucket.lua").read_text(encoding="utf-8")
TIMEOUT_S = 0.25  # connect and reply: a dead Redis must not stall requests
RETRY_S = 1.0  # while falling back, how often one request tries Redis again


def share(rates: dict[str, Rate], replicas: int) -> dict[str, Rate]:
    """One replica's part of each rate: what it enforces alone while Redis is away."""
    return {family: Rate(max(1, rate.burst // replicas), rate.per_second / replicas)
            for family, rate in rates.items()}


def without_secrets(url: str) -> str:
    """The Redis URL as logs may show it: no user, password or query (which may hold one)."""
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2], query="").geturl()


class RedisLimiter:
    """Per (family, client) buckets and one global bucket per family, kept in Redis and
    shared by every replica that uses the same ``prefix``; a local share while Redis is
    away (``fallback``).

    Its Redis client is made inside the event loop that first uses it (asyncio
    connections belong to one loop, and a replica serves on a loop of its own); a call
    from another loop gets a client of its own."""

    def __init__(self, url: str, per_client: dict[str, Rate], global_rates: dict[str, Rate],
                 *, prefix: str = "vramguard", replicas: int = 1,
                 timeout_s: float = TIMEOUT_S) -> None:
        self.url = url
        self.prefix = prefix
        self.timeout_s = timeout_s  # connect and reply; past it, the local share
        self.per_client = per_client
        self.global_rates = global_rates
        self.replicas = replicas
        self.local = RateLimiter(share(per_client, replicas), share(global_rates, replicas))
        self.fallbacks = 0  # times this limiter started working from its local share
        self._fallback = False
        self._retry_at = 0.0
        self._rejected = 0
        self._client: Redis | None = None
        self._script: AsyncScript | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> RedisLimiter:
        """The appliance's rates (``make_limiter``'s table), kept in ``redis_url``."""
        if settings.redis_url is None:
            raise ValueError("redis_url is not set: the shared rate limits need a Redis "
                             "server (e.g. redis://localhost:6379/0)")
        per_client, global_rates = limit_rates(settings)
        return cls(settings.redis_url, per_client, global_rates,
                   prefix=settings.redis_prefix, replicas=settings.replicas,
                   timeout_s=settings.redis_timeout_s)

    @property
    def rejected(self) -> int:
        """Refusals counted, from Redis's buckets and from the local share."""
        return self._rejected + self.local.rejected

    @property
    def fallback(self) -> bool:
        return self._fallback

    async def acquire(self, family: str, client: str, *, shared: bool = True,
                      counted: bool = True) -> Decision:
        rate = self.per_client.get(family)
        if rate is None:
            return Decision(True, 0, 0, 0.0)
        probing = self._fallback
        if probing:
            if time.monotonic() < self._retry_at:
                return self.local.check(family, client, shared=shared, counted=counted)
            self._retry_at = time.monotonic() + RETRY_S  # this request probes, others stay local
        base = f"{self.prefix}:rl:{{{family}}}"
        keys, args = [f"{base}:c:{client}"], [rate.burst, rate.per_second]
        common = self.global_rates.get(family) if shared else None
        if common is not None:
            keys.append(f"{base}:g")
            args += [common.burst, common.per_second]
        script = self._bucket_script()
        try:
            reply = await script(keys=keys, args=args)
        except (RedisError, OSError, RuntimeError) as error:
            # RuntimeError: uvloop (the loop Ray Serve's replicas run) raises it for a write
            # on a pooled connection whose transport has closed, where asyncio's loop
            # raises a ConnectionError; both mean "Redis cannot be reached now".
            self._fall_back(error)
            if script is self._script:  # its idle connections may lead to a dead server
                await self._drop_idle_connections()
            return self.local.check(family, client, shared=shared, counted=counted)
        if probing and self._fallback:
            self._fallback = False
            log.info("Redis at %s answers again: the rate limits are shared by all replicas "
                     "again.", without_secrets(self.url))
        allowed, remaining, reset_ms, wait_ms = (int(value) for value in reply)
        if allowed:
            return Decision(True, rate.burst, remaining, reset_ms / 1000)
        if counted:
            self._rejected += 1
        return Decision(False, rate.burst, 0, reset_ms / 1000, wait_ms / 1000)

    async def aclose(self) -> None:
        """Close the Redis connections (the replica is stopping)."""
        client, self._client, self._script, self._loop = self._client, None, None, None
        if client is not None:
            with contextlib.suppress(RedisError, OSError):  # a dead server's sockets
                await client.aclose()

    async def _drop_idle_connections(self) -> None:
        """Close the pool's idle connections, never those other requests are using: pulled
        from under a request still sending, redis-py raised AttributeError (a 500) where
        that request should have fallen back like this one. Those fail or finish alone."""
        if self._client is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._client.connection_pool.disconnect(inuse_connections=False)

    def _bucket_script(self) -> AsyncScript:
        """The script, bound to a client of the running loop (made on first use)."""
        loop = asyncio.get_running_loop()
        if self._script is None or self._loop is not loop:
            self._client = Redis.from_url(self.url, socket_timeout=self.timeout_s,
                                          socket_connect_timeout=self.timeout_s,
                                          retry=Retry(NoBackoff(), 0))
            self._script = self._client.register_script(SCRIPT)
            self._loop = loop
        return self._script

    def _fall_back(self, error: Exception) -> None:
        """Work from the local share until the next try; say so once per outage."""
        self._retry_at = time.monotonic() + RETRY_S
        if self._fallback:
            return
        self._fallback = True
        self.fallbacks += 1
        where, why = without_secrets(self.url), str(error).rstrip(".") or type(error).__name__
        if isinstance(error, RedisConnectionError | RedisTimeoutError | OSError | RuntimeError):
            log.warning("Cannot reach Redis at %s (%s). The rate limits shared by all "
                        "replicas are not in force: this replica enforces its own share of "
                        "them (each limit divided by %d) and tries Redis again every %g "
                        "s.", where, why, self.replicas, RETRY_S)
        else:
            log.error("Redis at %s refused the rate-limit script (%s). This replica "
                      "enforces its own share of the limits (each divided by %d) until "
                      "Redis accepts it again. Check that nothing else writes keys starting "
                      "with '%s:rl:', and Redis's memory limit and access rights.",
                      where, why, self.replicas, self.prefix)
