"""Recovery from out-of-memory in a forward pass: free, split in halves, retry.

The process never dies of it: a batch that does not fit is split until the
halves fit; a single image that still does not fit gets 503
``insufficient_memory``, and everything else carries on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from app.engine.predictor import Prediction, Sample
from app.errors import InsufficientMemory
from app.memory.guard import MemoryGuard
from app.memory.probes import Probe

Outcome = Prediction | InsufficientMemory


class OomRecovery:
    """Runs ``forward`` on the device thread and turns OOMs into splits and retries."""

    def __init__(self, forward: Callable[[list[Sample]], list[Prediction]], guard: MemoryGuard,
                 probe: Probe) -> None:
        self.forward = forward
        self.guard = guard
        self.probe = probe

    def __call__(self, samples: list[Sample]) -> list[Outcome]:
        try:
            with self.probe.forward_scope():
                return list(self.forward(samples))
        except torch.OutOfMemoryError:
            pass
        # Outside the except block the exception, its traceback and the frames that held
        # the batch's activations are gone, so the memory can really be given back.
        self.guard.on_oom(len(samples), self.probe.in_use())
        self.probe.empty_cache()
        if len(samples) == 1:
            self.guard.counters.oom_failures += 1
            return [InsufficientMemory(
                "Not enough GPU memory for this image right now, even on its own. Close "
                "other programs that use the graphics card, or try again later.",
                retry_after=5)]
        middle = len(samples) // 2
        outcomes = self(samples[:middle]) + self(samples[middle:])
        if not any(isinstance(o, InsufficientMemory) for o in outcomes):
            self.guard.counters.oom_recoveries += 1
        return outcomes
