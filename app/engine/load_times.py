"""How long until a model being loaded is ready: the ``Retry-After`` of the 503 ``loading``
answer a request gets when its deadline passes while it waits for the load.

The rule: a load is expected to take as long as the last load of that model in this
process, measured; a model not loaded before, as long per byte of its weights file as the
loads measured so far of the same kind (while serving, only batch size 1 is measured at
load; at start, every size), the on-demand kind first; with nothing measured,
``FIRST_GUESS_S``. Loads run one at a time on the device thread, so a load not begun yet
waits for the ones in progress. Past its expected end, a load is expected to need a
quarter of its expected time more. Noted on the device thread, read on the event loop.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from app.engine.runtime import Clock

FIRST_GUESS_S = 5.0  # nothing measured yet in this process (the --model loads first)
OVERDUE_SHARE = 0.25


@dataclass(frozen=True)
class _Load:
    began: float
    expected_s: float


class LoadTimes:
    """Loads in progress and the seconds measured for those done."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._running: dict[str, _Load] = {}
        self._last_s: dict[str, float] = {}  # by model, its last load
        self._rates: dict[bool, tuple[float, int]] = {}  # by first_only: seconds, bytes

    def began(self, name: str, weights_bytes: int, first_only: bool) -> None:
        with self._lock:
            self._running[name] = _Load(self._clock(),
                                        self._expected(name, weights_bytes, first_only))

    def ended(self, name: str, weights_bytes: int, first_only: bool, ok: bool) -> None:
        with self._lock:
            load = self._running.pop(name, None)
            if load is None or not ok:
                return
            took = self._clock() - load.began
            self._last_s[name] = took
            seconds, size = self._rates.get(first_only, (0.0, 0))
            self._rates[first_only] = (seconds + took, size + max(0, weights_bytes))

    def _expected(self, name: str, weights_bytes: int, first_only: bool) -> float:
        if name in self._last_s:
            return self._last_s[name]
        for kind in (first_only, not first_only):
            seconds, size = self._rates.get(kind, (0.0, 0))
            if seconds > 0 and size > 0 and weights_bytes > 0:
                return seconds / size * weights_bytes
        return FIRST_GUESS_S

    def seconds_left(self, name: str) -> float:
        """Seconds until ``name`` is expected to be loaded (at least 1)."""
        now = self._clock()
        with self._lock:
            load = self._running.get(name)
            if load is None:  # queued behind the loads in progress
                ahead = sum(self._left(other, now) for other in self._running.values())
                return max(1.0, ahead + self._last_s.get(name, FIRST_GUESS_S))
            return max(1.0, self._left(load, now))

    @staticmethod
    def _left(load: _Load, now: float) -> float:
        left = load.began + load.expected_s - now
        return left if left > 0 else OVERDUE_SHARE * load.expected_s
