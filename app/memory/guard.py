"""The memory guard: how many images fit now, the watermark state, what an OOM teaches.

Admission sizes batches so their predicted peak stays under the HIGH
watermark (``floor((high - in_use - c) / k)``): crossing it then means reality
was worse than the measurement (fragmentation, another program grabbing the
GPU), and that is what the ``shedding`` state reacts to. Sizing batches to the
whole budget instead would put every full batch over the watermark.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, replace

from app.memory.budget import Budget
from app.memory.fit import MemoryFit
from app.schemas import GuardState
from app.units import human_bytes

log = logging.getLogger("vramguard.memory")


@dataclass
class GuardCounters:
    oom_events: int = 0
    oom_recoveries: int = 0
    oom_failures: int = 0
    state_changes: int = 0
    idle_releases: int = 0
    cache_empties: int = 0


class MemoryGuard:
    """Thread-safe; the device thread asks and reports, the API reads."""

    def __init__(self, budget: Budget, fit: MemoryFit, *, max_batch: int,
                 high: float = 0.9, low: float = 0.75) -> None:
        if not 0 < low < high <= 1:
            raise ValueError("watermarks need 0 < low < high <= 1")
        self.budget = budget
        self.configured_bytes = budget.bytes
        self.budget_bytes = budget.bytes
        self.profiled = fit
        self.fit = fit
        self.max_batch = max_batch
        self.high_fraction, self.low_fraction = high, low
        self.state = GuardState.OK
        self.usage = 0
        self.counters = GuardCounters()
        self._others_growth = 0
        self._lock = threading.Lock()

    @property
    def high_bytes(self) -> int:
        return int(self.budget_bytes * self.high_fraction)

    @property
    def low_bytes(self) -> int:
        return int(self.budget_bytes * self.low_fraction)

    def shrink_for_others(self, others_growth: int) -> None:
        """Other programs took ``others_growth`` bytes since the budget was computed: give
        them room. The budget never grows past the configured one."""
        with self._lock:
            self._others_growth = max(0, others_growth)
            self.budget_bytes = max(0, self.configured_bytes - self._others_growth)

    def set_budget(self, budget: Budget) -> None:
        """A model loaded or unloaded: a budget from a fresh reading, whose overhead holds
        what other programs use now; their growth is counted again from zero."""
        with self._lock:
            self.budget = budget
            self.configured_bytes = budget.bytes
            self._others_growth = 0
            self.budget_bytes = budget.bytes

    def max_batch_now(self, in_use: int) -> int:
        """Images that fit now; 0 when not even one does by measurement."""
        with self._lock:
            room = self.high_bytes - in_use - self.fit.fixed_bytes
            if room < self.profiled.bytes_per_sample:
                return 0
            fits = max(1, room // self.fit.bytes_per_sample)
            limit = 1 if self.state is GuardState.SHEDDING else self.max_batch
            return int(min(fits, limit))

    def observe(self, usage: int) -> GuardState:
        """Move between ok / high / shedding; shedding is left only below LOW."""
        with self._lock:
            self.usage = usage
            old = self.state
            stays_shedding = old is GuardState.SHEDDING and usage > self.low_bytes
            if self.budget_bytes <= 0 or usage >= self.high_bytes or stays_shedding:
                new = GuardState.SHEDDING
            elif usage >= self.low_bytes:
                new = GuardState.HIGH
            else:
                new = GuardState.OK
            if new is not old:
                self.state = new
                self.counters.state_changes += 1
                log.warning("memory state %s -> %s: %s in use, budget %s (low %s, high %s)",
                            old, new, human_bytes(usage), human_bytes(self.budget_bytes),
                            human_bytes(self.low_bytes), human_bytes(self.high_bytes))
            return new

    def on_oom(self, batch_size: int, in_use: int) -> None:
        """A batch of ``batch_size`` ran out of memory: raise k so at most half fits next."""
        with self._lock:
            self.counters.oom_events += 1
            room = max(1, self.high_bytes - in_use - self.fit.fixed_bytes)
            learned = math.ceil(room / max(1, batch_size // 2))
            if learned > self.fit.bytes_per_sample:
                self.fit = replace(self.fit, bytes_per_sample=learned)
        log.warning("out of memory with a batch of %d; bytes per sample now %s",
                    batch_size, human_bytes(self.fit.bytes_per_sample))

    def reprofile(self, fit: MemoryFit, max_batch: int) -> None:
        """More batch sizes were measured: the new fit, trusted (what OOMs taught under the
        old one is forgotten), and the largest batch size now measured to fit."""
        with self._lock:
            self.profiled = self.fit = fit
            self.max_batch = max_batch

    def relax(self) -> None:
        """Forget what OOMs taught (after memory was given back): trust the profile again."""
        with self._lock:
            self.fit = self.profiled
