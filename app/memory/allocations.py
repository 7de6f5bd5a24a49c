"""Large allocations a batch was not expected to make, logged once with their Python stack.

Warmup measured what a batch of n needs above what was in use before it
(``c + k x n``). A batch that goes beyond that by more than
``large_allocation_bytes`` shows in its peak, which the probe reads after every
batch anyway, so noticing it costs nothing. The next batch of that size then
runs under a dispatch mode that sees every tensor an operator returns; the
first one larger than the setting made while memory is beyond the expected
peak is logged with the Python stack that made it, once per place.

Why a dispatch mode and not the CUDA allocator's history: both cost nothing
while off, but the history, to be there when needed, must record every
allocation of every thread all the time (about 2 us and several KB each, per
PyTorch's documentation), is read through a snapshot of every segment taken
on the device thread, tells at what total an allocation happened only by
replaying the whole ring, exists only on CUDA, and is what the admin
``record-history`` route switches on and off. The dispatch mode runs only for
the one batch being inspected, sees the total at the moment of each
allocation and the exact stack, and works the same on the CPU, where the
tests prove it. What it cannot see: memory a library takes inside one
operator (cuDNN's or cuBLAS's workspace); the log says so when an inspected
batch went beyond its expectation without any such tensor.
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from app.memory.probes import Probe
from app.units import human_bytes

log = logging.getLogger("vramguard.memory")
STACK_FRAMES = 12  # enough to reach the model's own code from the operator


class LargeAllocationWatch:
    """Decides which batches to inspect and logs what the inspection finds.

    ``limit`` 0 turns it off: nothing is measured and no mode is ever entered.
    Each batch size is inspected at most once, so a recurring excess costs one
    slower batch per size, not one in two.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.logged = 0  # places logged
        self._armed: set[int] = set()
        self._inspected: set[int] = set()
        self._places: set[tuple[tuple[str, int], ...]] = set()

    @contextlib.contextmanager
    def batch(self, probe: Probe, size: int, expected: int) -> Iterator[None]:
        """Around one batch of ``size`` whose peak should stay within ``expected`` bytes
        above what is in use when it starts."""
        if not self.limit:
            yield
            return
        before = probe.in_use()
        if size in self._armed:
            self._armed.discard(size)
            self._inspected.add(size)
            catcher = _Catcher(self, probe, size, before + expected)
            with catcher:
                yield
            if not catcher.found:
                log.warning("A batch of %d again needed more memory than measured at "
                            "warmup, but no single tensor over %s made the difference: it "
                            "was taken inside a library (such as cuDNN's workspace) or by "
                            "many smaller tensors.", size, human_bytes(self.limit))
            return
        yield
        peak = probe.batch_peak()
        if peak is None or peak - before - expected < self.limit:
            return
        if size not in self._inspected:
            self._armed.add(size)
            log.warning("A batch of %d needed %s more memory than measured at warmup; the "
                        "next batch of %d is watched for allocations over %s.", size,
                        human_bytes(peak - before - expected), size, human_bytes(self.limit))

    def report(self, nbytes: int, size: int, stack: traceback.StackSummary) -> bool:
        """Log one large allocation unless its place was logged before; whether it was."""
        place = tuple((frame.filename, frame.lineno or 0) for frame in stack)
        if place in self._places:
            return False
        self._places.add(place)
        self.logged += 1
        log.warning("Large allocation: one tensor of %s in a batch of %d, beyond the memory "
                    "measured for that batch at warmup. Made here (most recent call last):"
                    "\n%s", human_bytes(nbytes), size, "".join(stack.format()).rstrip())
        return True


class _Catcher(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch: no hints
    """Sees every tensor an operator returns on this thread while it is entered."""

    def __init__(self, watch: LargeAllocationWatch, probe: Probe, size: int,
                 ceiling: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.watch = watch
        self.probe = probe
        self.size = size
        self.ceiling = ceiling
        self.found = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        in_use = self.probe.in_use()
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            nbytes = tensor.untyped_storage().nbytes()
            if nbytes >= self.watch.limit and in_use + nbytes > self.ceiling:
                stack = traceback.extract_stack()[:-1]  # without this frame
                self.watch.report(nbytes, self.size,
                                  traceback.StackSummary.from_list(stack[-STACK_FRAMES:]))
                self.found = True
        return out
