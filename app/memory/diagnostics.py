"""Conclusions drawn from memory readings over time: a fragmented cache, a leak.

One reading says how much tensors hold (allocated) and how much the caching
allocator keeps (reserved); the trouble it hides shows only against earlier
readings taken in the same situation. Idle moments are that situation: no
batch runs, so what tensors still hold is what the process keeps between
requests (the weights, a library's workspace), and it should be the same after
every quiet spell. The engine hands this module one reading per idle period
and acts on what it concludes (empty the cache, write an allocator snapshot);
this module touches no device, so its rules are tested with numbers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from app.units import human_bytes

# Fragmented: at least half of what the cache holds is free space inside segments that
# also hold live blocks (``inactive_split_bytes``), which no allocation of another size can
# use and ``empty_cache`` cannot return (it frees only wholly free segments). Reserved
# against allocated says nothing of it: a warm GPU caches many times its weights.
FRAGMENTED_SHARE = 0.5
# Below this the split space is the allocator's rounding around the weights.
FRAGMENTED_MIN_BYTES = 64 * 1024**2
# A leak shows as memory left in use that rises at several idle periods without falling.
# One rise is normal (a library allocates its workspace once, at first use).
LEAK_RISES = 3
# Smaller moves are the allocator's rounding, not something kept.
LEAK_MIN_STEP = 1024**2
BASELINES_KEPT = 8
# With idle_release_s = 0 the cache is kept, but memory is still diagnosed after this quiet.
IDLE_PERIOD_S = 60.0


def is_fragmented(inactive_split: int, reserved: int) -> bool:
    """Whether at least FRAGMENTED_SHARE of the cache is split free space (and more than
    FRAGMENTED_MIN_BYTES of it)."""
    return (inactive_split >= FRAGMENTED_MIN_BYTES
            and inactive_split >= FRAGMENTED_SHARE * reserved)


def cache_verdict(device: str, allocated: int, reserved: int, inactive_split: int) -> str:
    """One line for `vramguard doctor` about the allocator cache right now."""
    if device == "cpu":
        return ("none on the CPU (freed memory goes straight back to the system), so it "
                "cannot fragment")
    held = (f"{human_bytes(reserved)} held for {human_bytes(allocated)} in use, "
            f"{human_bytes(inactive_split)} of it free space split between blocks in use")
    if is_fragmented(inactive_split, reserved):
        return (f"{held}: fragmented (at least {FRAGMENTED_SHARE:.0%}); emptying the cache "
                "cannot give that part back, a restart of vramguard does")
    return f"{held}: fine (fragmented from {FRAGMENTED_SHARE:.0%})"


def leak_check_verdict(tracked: bool, idle_s: float) -> str:
    """One line for `vramguard doctor` about the leak check."""
    if not tracked:
        return "off: on the CPU tensors are counted only with cpu_memory_cap set"
    return (f"after each quiet spell of {idle_s:.0f} s, warns when memory left in use has "
            f"risen {LEAK_RISES} times")


@dataclass(frozen=True)
class IdleFindings:
    """What one idle period showed, for the engine to act on."""

    fragmented: bool
    rising: bool  # memory left in use has risen since it last fell: worth watching
    leak_raised: bool  # this period raised the leak flag (it was down before)


class MemoryDiagnostics:
    """Keeps the idle baselines (bytes tensors hold at each idle period beyond the models'
    weights and kept workspaces) and the conclusions.

    ``warm_allocated`` is that level once warmup (or the last load or unload) was over:
    the level every later idle period should come back to.
    """

    def __init__(self, warm_allocated: int) -> None:
        self.warm_allocated = warm_allocated
        self.baselines: deque[int] = deque(maxlen=BASELINES_KEPT)
        self.leak_suspected = False
        self.fragmentation_releases = 0
        self._rises = 0

    @property
    def leak_growth(self) -> int:
        """Bytes held at the last idle period beyond what was held after warmup."""
        return max(0, self.baselines[-1] - self.warm_allocated) if self.baselines else 0

    def rebase(self, level: int) -> None:
        """Models were loaded or unloaded: ``level`` is the new warm level, and the levels
        and rises measured against the old one are dropped (the flag stays until memory
        is back at the new level at an idle period)."""
        self.warm_allocated = level
        self.baselines.clear()
        self._rises = 0

    def idle(self, allocated: int, reserved: int, inactive_split: int = 0) -> IdleFindings:
        """Take the reading of one idle period (before any cache is emptied).

        The leak flag goes up after LEAK_RISES rises with no fall between them (a quiet
        spell after requests that leak nothing leaves the count as it was) and comes
        down once memory left in use is back at the warm level.
        """
        previous = self.baselines[-1] if self.baselines else self.warm_allocated
        self.baselines.append(allocated)
        step = allocated - previous
        if step >= LEAK_MIN_STEP:
            self._rises += 1
        elif step <= -LEAK_MIN_STEP:
            self._rises = 0
        was = self.leak_suspected
        if self._rises >= LEAK_RISES:
            self.leak_suspected = True
        elif allocated - self.warm_allocated < LEAK_MIN_STEP:
            self.leak_suspected = False
        fragmented = is_fragmented(inactive_split, reserved)
        if fragmented:
            self.fragmentation_releases += 1
        return IdleFindings(fragmented, self._rises > 0, self.leak_suspected and not was)
