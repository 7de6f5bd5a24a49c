"""Who records the CUDA allocator's history: the leak tracer (the stacks of live blocks,
from the first rise of memory left in use) and the allocator-history route (every event
for a while, for a snapshot file) share torch's one switch.

The rule: history is recorded while either wants it, in the route's fuller mode while the
route wants it, and back in the tracer's mode (or off) when the route is done; one of them
turning its recording off never turns off the other's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ROUTE, TRACER = "route", "tracer"
HISTORY_MAX_ENTRIES = 50_000  # the route's: the newest events kept
MODES: dict[str, dict[str, Any]] = {
    ROUTE: {"stacks": "python", "max_entries": HISTORY_MAX_ENTRIES},
    TRACER: {"enabled": "state", "context": "state", "stacks": "python"},
}
OFF: dict[str, Any] = {"enabled": None}


def torch_switch(**mode: Any) -> None:
    import torch

    torch.cuda.memory._record_memory_history(**mode)


class AllocatorHistory:
    """The one switch, and who wants it on. Call on the device thread."""

    def __init__(self, switch: Callable[..., None] = torch_switch) -> None:
        self._switch = switch
        self._wanted: set[str] = set()
        self._mode: dict[str, Any] = OFF

    def want(self, who: str, on: bool) -> None:
        """``who`` (ROUTE or TRACER) wants recording on or no longer."""
        if on:
            self._wanted.add(who)
        else:
            self._wanted.discard(who)
        mode = next((MODES[w] for w in (ROUTE, TRACER) if w in self._wanted), OFF)
        if mode is not self._mode:
            self._switch(**mode)
            self._mode = mode

    def wanted_by(self, who: str) -> bool:
        return who in self._wanted
