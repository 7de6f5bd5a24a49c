"""The lanes of the micro-batcher: one model's bounded queue, its places kept in line and
what is measured about it, and the rules on them that need no thread: which queued items
must not run, how a batch is taken, and how long a newly admitted image would wait.

A lane is guarded by the batcher's lock (``app/engine/batcher.py``); every method here
that changes one expects the caller to hold it.
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from app.errors import Overloaded

P = TypeVar("P")
R = TypeVar("R")
log = logging.getLogger("vramguard.engine")
# The estimate of seconds per image is the median of the last batches: it follows a real
# change within a few batches, and one batch stalled by a busy machine does not swing it.
RATE_WINDOW = 15


def without_traceback(exc: Exception) -> Exception:
    """A copy of a batch's exception for one request to keep: the original's traceback
    holds the batch's frames, and with them its tensors (on a GPU, its activations), for
    as long as any request holds the exception. One copy per request, because each
    handler that raises it adds its own frames to its traceback."""
    try:
        clone = copy.copy(exc)  # type, args and attributes; no traceback, cause or context
    except Exception:
        clone = RuntimeError(str(exc))
    return clone.with_traceback(None)


@dataclass(eq=False)
class WorkItem(Generic[P, R]):
    """One queued request: its input, when it came, when it stops being worth computing."""

    payload: P
    enqueued_at: float
    deadline: float
    future: Future[R] = field(default_factory=Future)


@dataclass
class BatcherStats:
    """Counters since start; read without the lock (each is a single int)."""

    batches: int = 0
    items: int = 0
    expired: int = 0
    cancelled: int = 0
    failed_batches: int = 0
    largest_batch: int = 0
    sizes: Counter[int] = field(default_factory=Counter)

    @property
    def mean_batch_size(self) -> float:
        return self.items / self.batches if self.batches else 0.0

    def count_batch(self, size: int) -> None:
        self.batches += 1
        self.items += size
        self.largest_batch = max(self.largest_batch, size)
        self.sizes[size] += 1


class Reservation:
    """A place kept in line for a request whose image is still being read or decoded; it
    becomes a queued item on ``submit``, or is given back on leaving the ``with`` block."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release = release
        self.held = True

    def take(self) -> bool:
        """Use the place (once); False if it was already used or given back."""
        held, self.held = self.held, False
        return held

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.take():
            self._release()


class Lane(Generic[P, R]):
    """One model's queue and what is measured about it; the batcher's lock guards it."""

    def __init__(self, name: str, run_batch: Callable[[list[P]], Sequence[R]], max_batch: int,
                 batch_limit: Callable[[], int] | None) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.name = name
        self.run_batch = run_batch
        self.batch_limit = batch_limit
        self.max_batch = max_batch
        self.queue: deque[WorkItem[P, R]] = deque()
        self.reserved = 0
        self.in_flight = 0
        self.turn = 0  # when it was last served, in batches of the whole batcher
        self.seconds_per_item = 0.0
        self.recent: deque[float] = deque(maxlen=RATE_WINDOW)  # seconds per image
        self.last_end: float | None = None  # when its last batch ended
        self.had_backlog = False  # images were waiting when it ended
        # Only full batches are measured: the wait that admission predicts matters when a
        # backlog forms, and then batches are full. A lone image's batch costs more per
        # image (on a GPU, nearly as much as a full batch) and would refuse bursts.
        self.full = False
        self.stats = BatcherStats()

    @property
    def waiting(self) -> int:
        """Images admitted and not yet in a batch: being read or decoded, or queued."""
        return self.reserved + len(self.queue)

    def measure(self, took_s: float, items: int) -> None:
        """Add a batch's seconds per image to the recent ones; their median is the estimate."""
        if took_s <= 0:
            return
        self.recent.append(took_s / items)
        self.seconds_per_item = statistics.median(self.recent)

    def set_service_rate(self, items_per_second: float) -> None:
        self.seconds_per_item = 1.0 / items_per_second if items_per_second > 0 else 0.0
        self.recent.clear()

    def take_batch(self, now: float, count: Callable[[Lane[P, R], str], None],
                   expired: Callable[[], Exception],
                   dropped: list[tuple[WorkItem[P, R], Exception]]) -> list[WorkItem[P, R]]:
        """Pop up to the batch size of live items (capped by ``batch_limit``, the memory
        guard); expired or withdrawn ones are set aside in ``dropped``. Hold the lock."""
        batch: list[WorkItem[P, R]] = []
        limit = self.max_batch
        if self.batch_limit is not None:
            limit = min(limit, self.batch_limit())
        if limit <= 0:  # nothing fits: only clear out what has expired or been withdrawn
            self.drop_stale(now, count, expired, dropped)
            return batch
        answer_by = now + self.seconds_per_item * min(limit, len(self.queue))  # answers due
        while self.queue and len(batch) < limit:
            item = self.queue.popleft()
            if self.set_aside(item, answer_by, count, expired, dropped):
                continue
            if item.future.set_running_or_notify_cancel():
                batch.append(item)
            else:  # withdrawn just now
                count(self, "cancelled")
        self.in_flight = len(batch)
        self.full = len(batch) >= limit
        return batch

    def drop_stale(self, now: float, count: Callable[[Lane[P, R], str], None],
                   expired: Callable[[], Exception],
                   dropped: list[tuple[WorkItem[P, R], Exception]]) -> None:
        """Remove the withdrawn and the expired from the queue; keep the rest in order."""
        answer_by = now + self.seconds_per_item  # a batch of one, at the soonest
        self.queue = deque(item for item in self.queue
                           if not self.set_aside(item, answer_by, count, expired, dropped))

    def set_aside(self, item: WorkItem[P, R], answer_by: float,
                  count: Callable[[Lane[P, R], str], None], expired: Callable[[], Exception],
                  dropped: list[tuple[WorkItem[P, R], Exception]]) -> bool:
        """The one rule for a queued item that must not run: withdrawn (just counted), or
        unable to have its answer by its deadline (counted, and added to ``dropped`` to fail
        outside the lock). The deadline promises when the answer arrives, so an item whose
        batch would finish after it is not started."""
        if item.future.cancelled():
            count(self, "cancelled")
            return True
        if answer_by > item.deadline:
            count(self, "expired")
            dropped.append((item, expired()))
            return True
        return False


def predicted_wait(own: Lane[P, R], lanes: Sequence[Lane[P, R]]) -> float:
    """Seconds a request admitted now to ``own`` would wait: everything reserved, queued
    and running in its lane goes first, at the lane's measured rate, and so do the other
    lanes' batches that their turns put before its answer."""
    ahead = own.waiting + own.in_flight
    wait = ahead * own.seconds_per_item
    turns = math.ceil((own.waiting + 1) / own.max_batch)
    for other in lanes:
        if other is not own:
            wait += (min(other.waiting + other.in_flight, turns * other.max_batch)
                     * other.seconds_per_item)
    return wait


def check_room(own: Lane[P, R], lanes: Sequence[Lane[P, R]], queue_size: int,
               timeout_s: float) -> None:
    """Overloaded unless one more request fits in the queues (``queue_size`` for all lanes
    together) and its answer is predicted within ``timeout_s``: a fast no beats a slow one."""
    own_turn = predicted_wait(own, lanes) + own.seconds_per_item
    if sum(lane.waiting for lane in lanes) >= queue_size or own_turn > timeout_s:
        raise Overloaded("vramguard is busy: too many images are waiting. Try again shortly.",
                         retry_after=max(1.0, predicted_wait(own, lanes)))


def in_turn(lanes: Iterable[Lane[P, R]]) -> list[Lane[P, R]]:
    """Lanes with queued work, the one served least recently first; ties go to the
    earliest deadline at the head of a queue (the fairness rule between models)."""
    busy = [lane for lane in lanes if lane.queue]
    return sorted(busy, key=lambda lane: (lane.turn, lane.queue[0].deadline))


def run_call(fn: Callable[[], Any], future: Future[Any]) -> None:
    """Run a device-thread call into its future, unless it was cancelled first."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as exc:
        future.set_exception(exc)


def fail(item: WorkItem[P, R], error: Exception) -> None:
    if item.future.set_running_or_notify_cancel():
        item.future.set_exception(error)


def run_batch(lane: Lane[P, R], batch: list[WorkItem[P, R]],
              counters: tuple[BatcherStats, ...], clock: Callable[[], float]) -> None:
    """Run one batch of ``lane`` (on the device thread) and settle its futures: a result
    that is an exception fails its request, an exception raised fails the whole batch.
    The batch is counted before any of its answers goes out, so a client that reads the
    stats after its answer finds its batch there."""
    started = clock()
    # With a backlog, the time since the lane's last batch ended counts too (taking this
    # one, waiting for the interpreter lock): it is part of how fast the queue drains.
    began = lane.last_end if lane.had_backlog and lane.last_end is not None else started
    outcomes: list[R | BaseException]
    try:
        try:
            results = lane.run_batch([item.payload for item in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"batch of {len(batch)} gave {len(results)} results")
            if lane.full:
                lane.measure(clock() - began, len(batch))
            outcomes = list(results)
        except Exception as exc:
            log.exception("batch of %d failed", len(batch))
            for stats in counters:
                stats.failed_batches += 1
            outcomes = [without_traceback(exc) for _ in batch]
        finally:
            for stats in counters:
                stats.count_batch(len(batch))
            lane.in_flight = 0
        for item, outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                item.future.set_exception(outcome)
            else:
                item.future.set_result(outcome)
    finally:
        lane.last_end = clock()
        lane.had_backlog = bool(lane.queue)
