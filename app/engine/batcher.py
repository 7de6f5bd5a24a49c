"""The micro-batcher and the one thread that owns the device.

Requests go into a bounded queue. The device thread takes whatever is queued
(up to the batch size) as soon as it is free, so an idle device never waits;
while it is busy, new requests pile up and form the next batch. An optional
wait window lets a batch fill up, counted from its FIRST arrival (not from
when the thread looks), so no request waits longer than the window.

Everything that touches the device - loading, warmup, every forward pass -
runs on this thread: ``call`` hands it arbitrary work between batches.

A request is admitted before its image is even read (``reserve``): when the images
already admitted would keep its answer past its deadline, it is refused at once, so a
refusal never costs an upload or a decode. The wait is predicted from the seconds per
image the device thread measures on its own batches.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import statistics
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from app.errors import DeadlineExceeded, Overloaded

P = TypeVar("P")
R = TypeVar("R")
T = TypeVar("T")
log = logging.getLogger("vramguard.engine")
MEMORY_POLL_S = 0.05
# The estimate of seconds per image is the median of the last batches: it follows a real
# change within a few batches, and one batch stalled by a busy machine does not swing it.
RATE_WINDOW = 15
# An admitted image must be predicted to be answered within this share of its time: the
# rest absorbs its reading and decoding and the swings of the measured rate, so that
# little admitted work expires after it was read and decoded.
ADMISSION_SHARE = 0.8


def _without_traceback(exc: Exception) -> Exception:
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


class MicroBatcher(Generic[P, R]):
    """Bounded queue + dedicated device thread running ``run_batch`` on lists of payloads.

    ``run_batch`` must return one result per payload, in order; a result that
    is an exception fails just its request. An exception raised by
    ``run_batch`` fails exactly the requests of that batch; the thread carries
    on. ``batch_limit`` (the memory guard) caps each batch; while it says 0,
    requests wait, up to their deadline.
    """

    def __init__(
        self,
        run_batch: Callable[[list[P]], Sequence[R]],
        *,
        max_batch: int,
        max_wait_s: float = 0.0,
        queue_size: int = 256,
        clock: Callable[[], float] = time.monotonic,
        name: str = "vramguard-device",
        batch_limit: Callable[[], int] | None = None,
    ) -> None:
        if max_batch < 1 or queue_size < 1 or max_wait_s < 0:
            raise ValueError("max_batch and queue_size must be >= 1, max_wait_s >= 0")
        self._run_batch = run_batch
        self.batch_limit = batch_limit
        self._max_batch = max_batch
        self._max_wait_s = max_wait_s
        self._queue_size = queue_size
        self._clock = clock
        self._queue: deque[WorkItem[P, R]] = deque()
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._in_flight = 0
        self._reserved = 0
        self._seconds_per_item = 0.0
        self._recent: deque[float] = deque(maxlen=RATE_WINDOW)  # seconds per image
        self._last_end: float | None = None  # when the last batch ended
        self._backlog = False  # images were waiting when it ended
        # Only full batches are measured: the wait that admission predicts matters when a
        # backlog forms, and then batches are full. A lone image's batch costs more per
        # image (on a GPU, nearly as much as a full batch) and would refuse bursts.
        self._full = False
        self.stats = BatcherStats()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    # -- configuration ---------------------------------------------------------------------

    @property
    def max_batch(self) -> int:
        return self._max_batch

    def set_max_batch(self, size: int) -> None:
        """Change the batch size (e.g. after warmup has measured the best one)."""
        with self._cond:
            self._max_batch = max(1, size)
            self._cond.notify_all()

    def set_service_rate(self, items_per_second: float) -> None:
        """Start from this rate (warmup's, measured alone); every batch then updates it with
        what it took, which includes the decoding and HTTP work competing for the CPU."""
        self._seconds_per_item = 1.0 / items_per_second if items_per_second > 0 else 0.0
        self._recent.clear()

    @property
    def seconds_per_item(self) -> float:
        return self._seconds_per_item

    @property
    def reserved(self) -> int:
        return self._reserved

    @property
    def backlog(self) -> int:
        """Images admitted and not yet in a batch: being read or decoded, or queued."""
        return self._reserved + len(self._queue)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new work, fail what is still queued, and join the device thread."""
        with self._cond:
            self._stopping = True
            leftovers = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for item in leftovers:
            self._fail(item, Overloaded("vramguard is shutting down.", retry_after=5))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- submitting work -----------------------------------------------------------------------

    def retry_after(self) -> float:
        """Seconds until the current queue should have drained (at least 1)."""
        return max(1.0, self.predicted_wait())

    def predicted_wait(self) -> float:
        """Seconds a request admitted now would wait: everything reserved, queued and
        running goes first, at the measured service rate."""
        ahead = self._reserved + len(self._queue) + self._in_flight
        return ahead * self._seconds_per_item

    def _check_room(self, timeout_s: float) -> None:
        """Overloaded unless one more request fits in the queue and its answer is
        predicted within ``timeout_s`` (a fast no beats a slow one). Hold the lock."""
        if self._stopping:
            raise Overloaded("vramguard is shutting down.", retry_after=5)
        own_turn = self.predicted_wait() + self._seconds_per_item
        if self._reserved + len(self._queue) >= self._queue_size or own_turn > timeout_s:
            raise Overloaded("vramguard is busy: too many images are waiting. "
                             "Try again shortly.", retry_after=self.retry_after())

    def reserve(self, timeout_s: float) -> Reservation:
        """Keep a place in line for a request about to be read and decoded, or raise
        Overloaded at once when it could not be answered within ``timeout_s``."""
        with self._cond:
            self._check_room(timeout_s * ADMISSION_SHARE)
            self._reserved += 1
        return Reservation(self._unreserve)

    def _unreserve(self) -> None:
        with self._cond:
            self._reserved -= 1

    def submit(self, payload: P, timeout_s: float,
               reservation: Reservation | None = None) -> Future[R]:
        """Queue ``payload`` in the place ``reservation`` kept, or, without one, only if
        there is room (Overloaded otherwise)."""
        now = self._clock()
        item: WorkItem[P, R] = WorkItem(payload, now, now + timeout_s)
        with self._cond:
            if reservation is not None and reservation.take():
                self._reserved -= 1
                if self._stopping:
                    raise Overloaded("vramguard is shutting down.", retry_after=5)
            else:
                self._check_room(timeout_s)
            self._queue.append(item)
            self._cond.notify_all()
        return item.future

    async def infer(self, payload: P, timeout_s: float,
                    reservation: Reservation | None = None) -> R:
        """Submit and await the result; cancelling the caller withdraws a queued request."""
        return await asyncio.wrap_future(self.submit(payload, timeout_s, reservation))

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the device thread between batches (loading, warmup, cache release)."""
        future: Future[T] = Future()
        with self._cond:
            if self._stopping:
                raise RuntimeError("the device thread is stopping")
            self._calls.append((fn, future))
            self._cond.notify_all()
        return future

    # -- the device thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._calls and not self._stopping:
                    self._cond.wait()
                if self._calls:
                    call = self._calls.popleft()
                elif self._stopping:
                    return
                else:
                    call = None
                    self._wait_for_window()
                    batch, dropped = self._take_batch()
                    if not batch and self._queue:
                        self._cond.wait(MEMORY_POLL_S)  # nothing fits now: look again soon
            if call is not None:
                self._run_call(*call)
                continue
            for item, error in dropped:
                self._fail(item, error)
            if batch:
                self._run(batch)

    def _wait_for_window(self) -> None:
        """With a window configured, let the batch fill until FIRST arrival + window."""
        if self._max_wait_s <= 0:
            return
        close_at = self._queue[0].enqueued_at + self._max_wait_s
        while (len(self._queue) < self._max_batch and not self._stopping
               and not self._calls):
            remaining = close_at - self._clock()
            if remaining <= 0:
                return
            self._cond.wait(remaining)

    def _take_batch(self) -> tuple[list[WorkItem[P, R]], list[tuple[WorkItem[P, R], Exception]]]:
        """Pop up to max_batch live items; expired or withdrawn ones are set aside."""
        batch: list[WorkItem[P, R]] = []
        dropped: list[tuple[WorkItem[P, R], Exception]] = []
        now = self._clock()
        limit = self._max_batch
        if self.batch_limit is not None:
            limit = min(limit, self.batch_limit())
        if limit <= 0:  # nothing fits: only clear out what has expired or been withdrawn
            self._drop_stale(now, dropped)
            return batch, dropped
        answer_by = now + self._seconds_per_item * min(limit, len(self._queue))  # answers due
        while self._queue and len(batch) < limit:
            item = self._queue.popleft()
            if self._set_aside(item, answer_by, dropped):
                continue
            if item.future.set_running_or_notify_cancel():
                batch.append(item)
            else:  # withdrawn just now
                self.stats.cancelled += 1
        self._in_flight = len(batch)
        self._full = len(batch) >= limit
        return batch, dropped

    def _drop_stale(self, now: float, dropped: list[tuple[WorkItem[P, R], Exception]]) -> None:
        """Remove the withdrawn and the expired from the queue; keep the rest in order."""
        answer_by = now + self._seconds_per_item  # a batch of one, at the soonest
        self._queue = deque(item for item in self._queue
                            if not self._set_aside(item, answer_by, dropped))

    def _set_aside(self, item: WorkItem[P, R], answer_by: float,
                   dropped: list[tuple[WorkItem[P, R], Exception]]) -> bool:
        """The one rule for a queued item that must not run: withdrawn (just counted), or
        unable to have its answer by its deadline (counted, and added to ``dropped`` to fail
        outside the lock). The deadline promises when the answer arrives, so an item whose
        batch would finish after it is not started."""
        if item.future.cancelled():
            self.stats.cancelled += 1
            return True
        if answer_by > item.deadline:
            self.stats.expired += 1
            dropped.append((item, self._expired_error()))
            return True
        return False

    def _expired_error(self) -> DeadlineExceeded:
        return DeadlineExceeded("vramguard could not get to this image in time because it is "
                                "busy. Try again shortly.", retry_after=self.retry_after())

    def _run(self, batch: list[WorkItem[P, R]]) -> None:
        started = self._clock()
        # With a backlog, the time since the last batch ended counts too (taking this one,
        # waiting for the interpreter lock): it is part of how fast the queue drains.
        began = self._last_end if self._backlog and self._last_end is not None else started
        try:
            results = self._run_batch([item.payload for item in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"batch of {len(batch)} gave {len(results)} results")
            if self._full:
                self._measure(self._clock() - began, len(batch))
        except Exception as exc:
            log.exception("batch of %d failed", len(batch))
            self.stats.failed_batches += 1
            for item in batch:
                item.future.set_exception(_without_traceback(exc))
        else:
            for item, result in zip(batch, results, strict=True):
                if isinstance(result, BaseException):
                    item.future.set_exception(result)
                else:
                    item.future.set_result(result)
        finally:
            self.stats.batches += 1
            self.stats.items += len(batch)
            self.stats.largest_batch = max(self.stats.largest_batch, len(batch))
            self.stats.sizes[len(batch)] += 1
            self._in_flight = 0
            self._last_end = self._clock()
            self._backlog = bool(self._queue)

    def _measure(self, took_s: float, items: int) -> None:
        """Add a batch's seconds per image to the recent ones; their median is the estimate."""
        if took_s <= 0:
            return
        self._recent.append(took_s / items)
        self._seconds_per_item = statistics.median(self._recent)

    @staticmethod
    def _run_call(fn: Callable[[], Any], future: Future[Any]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    @staticmethod
    def _fail(item: WorkItem[P, R], error: Exception) -> None:
        if item.future.set_running_or_notify_cancel():
            item.future.set_exception(error)
