"""Which models stay loaded: keep-alive, least-recently-used eviction by measured memory,
and the limits that stop a client from making vramguard load and evict endlessly.

What a model takes is measured, not estimated: its weights, plus the peak of its batch
(``c + k x batch size``, from warmup or its stored profile). Only one batch runs at a time
(one device thread), so the models fit together when

    sum of the loaded models' weights + the largest of their batch peaks <= room

where ``room`` is what vramguard may hold on the device (see ``Budget.room``).

Who may change a model's stay: a request's keep-alive only lengthens it (``lengthen``), up
to a cap, unless it carries the admin token (``use``, any value), so that one app cannot
unload a model another app keeps (``keep_alive=0``) nor keep one loaded for ever (``-1``).
Who pays for a load: the client whose request caused it, within the limit for everyone
(``LoadRate``), so that one app asking for model after model cannot use up the others'.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

from app.errors import Overloaded

FOREVER = -1.0  # keep_alive value: never unload when idle


class StayNote(StrEnum):
    """Why a request's keep-alive was not done as asked (``Residency.lengthen``)."""

    IGNORED = "ignored"  # shorter than the stay, or -1: needs the admin token
    CAPPED = "capped"  # longer than the cap: cut to it


@dataclass(frozen=True)
class Footprint:
    """What a model needs on the device: its weights, and the peak of one batch."""

    weights: int
    batch_peak: int


NOTHING = Footprint(0, 0)  # what is loaded must fit by itself (a share that shrank)


def needed(footprints: Iterable[Footprint]) -> int:
    """Bytes the models need together: every weight, and the largest batch of any one."""
    prints = list(footprints)
    return sum(p.weights for p in prints) + max((p.batch_peak for p in prints), default=0)


@dataclass
class Residency:
    """A loaded model's place on the device."""

    name: str
    footprint: Footprint
    loaded_at: float
    last_used: float
    keep_alive_s: float  # FOREVER, 0 (unload once idle) or seconds after the last use
    pinned: bool = False

    def use(self, now: float, keep_alive_s: float | None = None) -> None:
        """A request came: it counts as use now, and (an admin's) may set how long it
        stays, shorter included."""
        self.last_used = now
        if keep_alive_s is not None:
            self.keep_alive_s = keep_alive_s

    def lengthen(self, asked_s: float, cap_s: float) -> StayNote | None:
        """A request without the admin token asked the model to stay ``asked_s`` after each
        use: it only ever lengthens the stay, up to ``cap_s``. What was not done as asked
        (None: done): a shorter stay, 0 and -1 (for ever) are ignored; a longer one than
        ``cap_s`` is cut to it (a stay already longer is kept)."""
        if asked_s < 0 or self.keep_alive_s < 0 or asked_s < self.keep_alive_s:
            return StayNote.IGNORED
        self.keep_alive_s = max(self.keep_alive_s, min(asked_s, cap_s))
        return StayNote.CAPPED if asked_s > cap_s else None

    def expired(self, now: float) -> bool:
        """Idle for longer than its keep-alive (a pinned model never expires)."""
        if self.pinned or self.keep_alive_s < 0:
            return False
        return now - self.last_used >= self.keep_alive_s

    def expires_in(self, now: float) -> float | None:
        """Seconds until it unloads if nothing uses it; None when it stays."""
        if self.pinned or self.keep_alive_s < 0:
            return None
        return max(0.0, self.last_used + self.keep_alive_s - now)


def plan_evictions(residents: Iterable[Residency], incoming: Footprint, room: int, now: float,
                   busy: Callable[[str], bool], min_residency_s: float) -> list[str] | None:
    """The models to unload, least recently used first, so that ``incoming`` fits; [] when
    it fits already, None when it cannot fit even after every evictable one has gone.

    Never evicted: a pinned model, one with work queued or in progress (``busy``), and one
    loaded less than ``min_residency_s`` ago (so that clients asking for models in turn
    cannot make vramguard spend all its time loading)."""
    staying = sorted(residents, key=lambda r: r.last_used)
    victims: list[str] = []
    candidates = evictable(staying, now, busy, min_residency_s)
    while needed([*(r.footprint for r in staying), incoming]) > room:
        if not candidates:
            return None
        victim = candidates.pop(0)
        staying.remove(victim)
        victims.append(victim.name)
    return victims


def evictable(residents: Iterable[Residency], now: float, busy: Callable[[str], bool],
              min_residency_s: float) -> list[Residency]:
    """The models that may be unloaded to make room, least recently used first: the one
    rule of eviction (see ``plan_evictions``)."""
    return sorted((r for r in residents if not r.pinned and not busy(r.name)
                   and now - r.loaded_at >= min_residency_s), key=lambda r: r.last_used)


class LoadRate:
    """At most ``per_minute`` loads in any 60 s, and at most ``per_client`` of them caused
    by one client's requests: more is answered 503 with a Retry-After that says when the
    oldest load that counts leaves the window. A load no client asked for (an admin's,
    the ones at start) counts only for everyone. Memory is bounded: a client is kept only
    while one of its loads is in the window, and every load in it counts for everyone."""

    WINDOW_S = 60.0

    def __init__(self, per_minute: int, clock: Callable[[], float],
                 per_client: int | None = None) -> None:
        self.per_minute = per_minute
        self.per_client = per_minute if per_client is None else min(per_client, per_minute)
        self._clock = clock
        self._loads: deque[float] = deque()
        self._by_client: dict[str, deque[float]] = {}

    def take(self, client: str | None = None) -> None:
        """Count a load about to start for ``client``, or raise Overloaded."""
        now = self._clock()
        for loads in (self._loads, *self._by_client.values()):
            while loads and now - loads[0] >= self.WINDOW_S:
                loads.popleft()
        self._by_client = {key: loads for key, loads in self._by_client.items() if loads}
        mine = self._by_client.get(client) if client is not None else None
        if mine is not None and len(mine) >= self.per_client:
            wait = self._wait(mine, now)
            raise Overloaded(
                f"Requests from this app ({client}) have made vramguard load "
                f"{self.per_client} models in the last minute, the most one app may, so that "
                f"it cannot keep other apps from loading theirs. Try again in {wait} s, or "
                "ask for a model that is already loaded. (Apps that send no X-Client-Id "
                "header share one such limit.)", retry_after=wait)
        if len(self._loads) >= self.per_minute:
            raise Overloaded(
                f"vramguard has loaded {self.per_minute} models in the last minute, its "
                "limit, so as not to spend its time swapping models in and out of memory. "
                "Try again shortly, or ask for a model that is already loaded.",
                retry_after=self._wait(self._loads, now))
        self._loads.append(now)
        if client is not None:
            self._by_client.setdefault(client, deque()).append(now)

    def _wait(self, loads: deque[float], now: float) -> int:
        return max(1, math.ceil(loads[0] + self.WINDOW_S - now))
