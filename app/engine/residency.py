"""Which models stay loaded: keep-alive, least-recently-used eviction by measured memory,
and the limits that stop a client from making vramguard load and evict endlessly.

What a model takes is measured, not estimated: its weights, plus the peak of its batch
(``c + k x batch size``, from warmup or its stored profile). Only one batch runs at a time
(one device thread), so the models fit together when

    sum of the loaded models' weights + the largest of their batch peaks <= room

where ``room`` is what vramguard may hold on the device (see ``Budget.room``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from app.errors import Overloaded

FOREVER = -1.0  # keep_alive value: never unload when idle


@dataclass(frozen=True)
class Footprint:
    """What a model needs on the device: its weights, and the peak of one batch."""

    weights: int
    batch_peak: int


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
        """A request came: it counts as use now, and may change how long it stays."""
        self.last_used = now
        if keep_alive_s is not None:
            self.keep_alive_s = keep_alive_s

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
    """At most ``per_minute`` loads in any 60 s: more is answered 503 with a Retry-After
    that says when the oldest load leaves the window."""

    WINDOW_S = 60.0

    def __init__(self, per_minute: int, clock: Callable[[], float]) -> None:
        self.per_minute = per_minute
        self._clock = clock
        self._loads: deque[float] = deque()

    def take(self) -> None:
        """Count a load about to start, or raise Overloaded."""
        now = self._clock()
        while self._loads and now - self._loads[0] >= self.WINDOW_S:
            self._loads.popleft()
        if len(self._loads) >= self.per_minute:
            wait = self._loads[0] + self.WINDOW_S - now
            raise Overloaded(
                f"vramguard has loaded {self.per_minute} models in the last minute, its "
                "limit, so as not to spend its time swapping models in and out of memory. "
                "Try again shortly, or ask for a model that is already loaded.",
                retry_after=max(1, math.ceil(wait)))
        self._loads.append(now)
