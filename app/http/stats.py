"""Counters of answered requests by outcome, for /v1/stats."""

from __future__ import annotations

import threading
import time
from collections import Counter


class RequestStats:
    """Thread-safe outcome counter; ``ok`` and ``cached`` for successes, else the error code."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def count(self, outcome: str) -> None:
        with self._lock:
            self._counts[outcome] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started
