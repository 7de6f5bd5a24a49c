"""Warmup: time the model at growing batch sizes and pick the one that pays.

Bigger is not always faster: on a 2-core CPU EfficientNet-Lite0 is slower per
image at batch 8 than at batch 4, while a GPU keeps gaining. So the appliance
measures on its own device instead of assuming.

Only the batch call serving pays is timed. Its inputs are built before the clock
starts: random inputs cost 1.6 ms at batch 1 and 299 ms at 256 on one CPU thread,
more than a GPU's whole forward pass, and timing them would understate the GPU
severalfold. A size that runs out of memory (a small or busy GPU) ends the growth
instead of the start.

The measurement is written as steps (``profile_steps``: a generator that yields after each
forward pass), so that the device thread can run it whole at start (``run_through``) or a
pass at a time between batches, after a load that measured only what serving needs first.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TypeVar

from app.engine.oom import no_count, unless_out_of_memory

log = logging.getLogger("vramguard.engine")
Inputs = TypeVar("Inputs")  # whatever ``build`` makes for one batch
T = TypeVar("T")
Steps = Generator[None, None, T]  # yields after each forward pass, returns its result


def run_through(steps: Steps[T]) -> T:
    """Every step at once: the result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


@dataclass(frozen=True)
class BatchTiming:
    """Median wall time of one forward pass at ``batch_size``."""

    batch_size: int
    seconds: float

    @property
    def images_per_second(self) -> float:
        return self.batch_size / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class WarmupTimings:
    """What warmup measured and what it chose."""

    timings: list[BatchTiming] = field(default_factory=list)
    chosen_batch_size: int = 1
    duration_s: float = 0.0
    out_of_memory_at: int | None = None  # the batch size that ran out of memory, if any

    def throughput_at(self, batch_size: int) -> float:
        """Measured images/s at ``batch_size`` (or the largest size below it that was
        timed); 0 when nothing fits. A batch size set by the user may differ from the
        one warmup chose, and the queue's wait estimates must use the one in force."""
        timed = [t for t in self.timings if t.batch_size <= batch_size]
        return max(timed, key=lambda t: t.batch_size).images_per_second if timed else 0.0

    @property
    def images_per_second(self) -> float:
        """Throughput at the batch size warmup chose."""
        return self.throughput_at(self.chosen_batch_size)


def batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to ``max_batch`` (which is always included)."""
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return [*sizes, max_batch]


NEAR_TIE = 0.95


def choose_batch_size(timings: list[BatchTiming], target_latency_s: float) -> int:
    """The largest size within the latency target whose throughput is within 5 % of the
    best; 1 when no size meets the target.

    Near-ties go to the larger batch: serving adds per-batch costs warmup does not
    see (stacking inputs, thread hand-offs, answering each request), which a larger
    batch spreads thinner. Measured on a 2-core CPU: warmup saw batch 2 and 4 within
    1 %, and serving 32 clients was 1.35x the naive server at batch 4 but 1.08x at 2.
    """
    within = [t for t in timings if t.seconds <= target_latency_s]
    if not within:
        return 1
    best = max(t.images_per_second for t in within)
    return max(t.batch_size for t in within if t.images_per_second >= NEAR_TIE * best)


class OutOfMemoryAtWarmup(RuntimeError):
    """Not even one image fits: the start fails, saying what to do."""

    def __init__(self) -> None:
        super().__init__("There is not enough memory to run the model on even one image. "
                         "Close other programs that use the graphics card, then start "
                         "vramguard again.")


def timed(run: Callable[[Inputs], object], inputs: Inputs,
          clock: Callable[[], float] = time.perf_counter,
          ooms: Callable[[], int] = no_count) -> float | None:
    """Seconds ``run(inputs)`` took; None when it ran out of memory (``ooms``: the
    allocator's failure count, see ``unless_out_of_memory``)."""
    def call() -> float:
        t0 = clock()
        run(inputs)
        return clock() - t0

    return unless_out_of_memory(call, ooms)


def _nothing() -> None:
    """Nothing to give back (the CPU)."""


def profile_steps(
    run: Callable[[Inputs], object],
    max_batch: int,
    target_latency_s: float,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
    *,
    build: Callable[[int], Inputs],
    free: Callable[[], None] = _nothing,
    ooms: Callable[[], int] = no_count,
) -> Steps[WarmupTimings]:
    """Time ``run(build(batch_size))`` and choose a batch size; ``build`` is not timed.
    A step after each pass; the time between steps (batches served) is not counted.

    A first pass grows the size until a pass exceeds the latency target or runs out of
    memory (then ``free`` gives the cache back and no larger size is tried); then the
    repeats go round-robin over the sizes tried, so that a machine whose speed drifts (a
    shared desktop, a VM) slows every size alike instead of whichever happened to be
    measured during a slow second.
    """
    spent = 0.0  # seconds of passes and of what is between them within a step
    inputs: dict[int, Inputs] = {}
    out_of_memory_at = None
    for size in batch_sizes(max_batch):
        batch = build(size)
        # The first pass at a new shape pays for allocation and kernel choice.
        step = clock()
        first = timed(run, batch, clock, ooms)
        took = None if first is None else timed(run, batch, clock, ooms)
        spent += clock() - step
        yield
        if took is None:
            out_of_memory_at = size
            break
        inputs[size] = batch
        if took > target_latency_s:
            break
    del batch
    if out_of_memory_at is not None:
        free()
        if not inputs:
            raise OutOfMemoryAtWarmup()
        log.warning("warmup ran out of memory at a batch of %d: batches stay below it",
                    out_of_memory_at)
    samples: dict[int, list[float]] = {size: [] for size in inputs}
    for _ in range(repeats):
        for size in list(samples):
            step = clock()
            took = timed(run, inputs[size], clock, ooms)
            spent += clock() - step
            yield
            if took is None:  # memory got scarcer since (another program): stop there
                out_of_memory_at = size
                samples = {s: t for s, t in samples.items() if s < size}
                free()
                break
            samples[size].append(took)
    if not samples:
        raise OutOfMemoryAtWarmup()
    timings = [BatchTiming(size, statistics.median(times)) for size, times in samples.items()]
    chosen = choose_batch_size(timings, target_latency_s)
    return WarmupTimings(timings, chosen, spent, out_of_memory_at)
