"""The micro-batcher and the one thread that owns the device, shared by every model.

Each model has a lane: its own queue, batch size, memory limit and measured service
rate. The device thread serves the lanes with work in turn, the one served least
recently first (ties: the earliest deadline at the head of its queue), so a flood of
requests for one model delays another model's next batch by at most one batch of each
other busy model. Within a lane, requests go into a bounded queue. The device thread
takes whatever is queued (up to the batch size) as soon as it is free, so an idle
device never waits;
while it is busy, new requests pile up and form the next batch. An optional
wait window lets a batch fill up, counted from its FIRST arrival (not from
when the thread looks), so no request waits longer than the window.

Everything that touches the device - loading, warmup, every forward pass -
runs on this thread: ``call`` hands it arbitrary work between batches, before the next
one; ``when_idle`` hands it background work in short steps, each run when nothing else
waits or after a batch, so batches and background steps alternate under load.

A request is admitted before its image is even read (``reserve``): when the images
already admitted would keep its answer past its deadline, it is refused at once, so a
refusal never costs an upload or a decode. The wait is predicted from the seconds per
image the device thread measures on each lane's batches; a lane's wait counts the
batches of the other lanes that the turns put before it.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from app.engine.lanes import (
    BatcherStats,
    Lane,
    Reservation,
    WorkItem,
    check_room,
    fail,
    in_turn,
    predicted_wait,
    run_batch,
    run_call,
)
from app.errors import DeadlineExceeded, Overloaded

P = TypeVar("P")
R = TypeVar("R")
T = TypeVar("T")
MEMORY_POLL_S = 0.05
# An admitted image must be predicted to be answered within this share of its time: the
# rest absorbs its reading and decoding and the swings of the measured rate, so that
# little admitted work expires after it was read and decoded.
ADMISSION_SHARE = 0.8
DEFAULT_LANE = "default"


class MicroBatcher(Generic[P, R]):
    """Bounded queues + the dedicated device thread running each lane's ``run_batch`` on
    lists of its payloads.

    ``run_batch`` must return one result per payload, in order; a result that
    is an exception fails just its request. An exception raised by
    ``run_batch`` fails exactly the requests of that batch; the thread carries
    on. ``batch_limit`` (the memory guard) caps each batch; while it says 0,
    requests wait, up to their deadline. Given a ``run_batch``, the batcher starts
    with one lane, ``DEFAULT_LANE``. A call without a lane name means the first lane
    still open. ``queue_size`` bounds all lanes together.
    """

    def __init__(
        self,
        run_batch: Callable[[list[P]], Sequence[R]] | None = None,
        *,
        max_batch: int = 1,
        max_wait_s: float = 0.0,
        queue_size: int = 256,
        clock: Callable[[], float] = time.monotonic,
        name: str = "vramguard-device",
        batch_limit: Callable[[], int] | None = None,
    ) -> None:
        if max_batch < 1 or queue_size < 1 or max_wait_s < 0:
            raise ValueError("max_batch and queue_size must be >= 1, max_wait_s >= 0")
        self._max_wait_s = max_wait_s
        self._queue_size = queue_size
        self._clock = clock
        self._lanes: dict[str, Lane[P, R]] = {}
        self._turns = itertools.count(1)
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._idle: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._idle_owed = False  # a batch has run since the last background step
        self._cond = threading.Condition()
        self._stopping = False
        self.stats = BatcherStats()  # every lane's batches together
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        if run_batch is not None:
            self.add_lane(DEFAULT_LANE, run_batch, max_batch=max_batch, batch_limit=batch_limit)

    # -- lanes -------------------------------------------------------------------------------

    def add_lane(self, name: str, run_batch: Callable[[list[P]], Sequence[R]], *,
                 max_batch: int = 1, batch_limit: Callable[[], int] | None = None
                 ) -> Lane[P, R]:
        """A new lane (a model that has just loaded); its requests start being served."""
        lane = Lane(name, run_batch, max_batch, batch_limit)
        with self._cond:
            if name in self._lanes:
                raise ValueError(f"lane {name!r} exists")
            self._lanes[name] = lane
        return lane

    def remove_lane(self, name: str, error: Exception) -> None:
        """Remove a lane (its model unloads): whatever is still queued fails with ``error``.
        Places reserved in it are refused when they submit."""
        with self._cond:
            lane = self._lanes.pop(name, None)
            leftovers = list(lane.queue) if lane is not None else []
            if lane is not None:
                lane.queue.clear()
        for item in leftovers:
            fail(item, error)

    def lane(self, name: str | None = None) -> Lane[P, R]:
        """The lane called ``name`` (KeyError if none); without a name, the first lane
        still open (the batcher's own, or the engine's first model's)."""
        if name is None:
            return next(iter(self._lanes.values()))  # StopIteration: no lane at all
        return self._lanes[name]

    @property
    def lanes(self) -> list[Lane[P, R]]:
        return list(self._lanes.values())

    # -- configuration ---------------------------------------------------------------------

    @property
    def max_batch(self) -> int:
        return self.lane().max_batch

    def set_max_batch(self, size: int, lane: str | None = None) -> None:
        """Change a lane's batch size (e.g. after warmup has measured the best one)."""
        with self._cond:
            self.lane(lane).max_batch = max(1, size)
            self._cond.notify_all()

    def set_service_rate(self, items_per_second: float, lane: str | None = None) -> None:
        """Start from this rate (warmup's, measured alone); every batch then updates it with
        what it took, which includes the decoding and HTTP work competing for the CPU."""
        self.lane(lane).set_service_rate(items_per_second)

    @property
    def seconds_per_item(self) -> float:
        return self.lane().seconds_per_item

    @property
    def reserved(self) -> int:
        return sum(lane.reserved for lane in self.lanes)

    @property
    def backlog(self) -> int:
        """Images admitted and not yet in a batch, in every lane."""
        return sum(lane.waiting for lane in self.lanes)

    @property
    def queue_depth(self) -> int:
        return sum(len(lane.queue) for lane in self.lanes)

    @property
    def in_flight(self) -> int:
        return sum(lane.in_flight for lane in self.lanes)

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
            leftovers = [item for lane in self._lanes.values() for item in lane.queue]
            for lane in self._lanes.values():
                lane.queue.clear()
            self._cond.notify_all()
        for item in leftovers:
            fail(item, Overloaded("vramguard is shutting down.", retry_after=5))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- submitting work -----------------------------------------------------------------------

    def retry_after(self, lane: str | None = None) -> float:
        """Seconds until the lane's queue should have drained (at least 1)."""
        return max(1.0, self.predicted_wait(lane))

    def predicted_wait(self, lane: str | None = None) -> float:
        """Seconds a request admitted now to ``lane`` would wait (``lanes.predicted_wait``)."""
        return predicted_wait(self.lane(lane), self.lanes)

    def _check_room(self, lane: Lane[P, R], timeout_s: float) -> None:
        """Overloaded unless one more request fits in the queues and its answer is
        predicted within ``timeout_s`` (a fast no beats a slow one). Hold the lock."""
        if self._stopping:
            raise Overloaded("vramguard is shutting down.", retry_after=5)
        check_room(lane, self.lanes, self._queue_size, timeout_s)

    def reserve(self, timeout_s: float, lane: str | None = None) -> Reservation:
        """Keep a place in ``lane`` for a request about to be read and decoded, or raise
        Overloaded at once when it could not be answered within ``timeout_s``."""
        with self._cond:
            own = self.lane(lane)
            self._check_room(own, timeout_s * ADMISSION_SHARE)
            own.reserved += 1
        return Reservation(lambda: self._unreserve(own))

    def _unreserve(self, lane: Lane[P, R]) -> None:
        with self._cond:
            lane.reserved -= 1

    def submit(self, payload: P, timeout_s: float, reservation: Reservation | None = None,
               lane: str | None = None) -> Future[R]:
        """Queue ``payload`` in the place ``reservation`` kept, or, without one, only if
        there is room (Overloaded otherwise)."""
        now = self._clock()
        item: WorkItem[P, R] = WorkItem(payload, now, now + timeout_s)
        with self._cond:
            own = self._lanes.get(lane) if lane is not None else next(
                iter(self._lanes.values()), None)
            if reservation is not None and reservation.take():
                if own is not None:
                    own.reserved -= 1
                if self._stopping:
                    raise Overloaded("vramguard is shutting down.", retry_after=5)
            elif own is not None:
                self._check_room(own, timeout_s)
            if own is None:
                raise Overloaded("The model was unloaded while this image was being read. "
                                 "Try again.", retry_after=1)
            own.queue.append(item)
            self._cond.notify_all()
        return item.future

    async def infer(self, payload: P, timeout_s: float,
                    reservation: Reservation | None = None, lane: str | None = None) -> R:
        """Submit and await the result; cancelling the caller withdraws a queued request."""
        return await asyncio.wrap_future(self.submit(payload, timeout_s, reservation, lane))

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the device thread between batches (loading, warmup, cache release)."""
        return self._enqueue(self._calls, fn)

    def when_idle(self, fn: Callable[[], T]) -> Future[T]:
        """As ``call``, for background work: ``fn`` runs when no call waits, once no batch
        waits or a batch has run since the last such step (one short step each)."""
        return self._enqueue(self._idle, fn)

    def _enqueue(self, calls: deque[tuple[Callable[[], Any], Future[Any]]],
                 fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        with self._cond:
            if self._stopping:
                raise RuntimeError("the device thread is stopping")
            calls.append((fn, future))
            self._cond.notify_all()
        return future

    # -- the device thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while (not self._has_work() and not self._calls and not self._idle
                       and not self._stopping):
                    self._cond.wait()
                if self._calls:
                    call = self._calls.popleft()
                elif self._stopping:
                    return
                elif self._idle and (self._idle_owed or not self._has_work()):
                    call, self._idle_owed = self._idle.popleft(), False
                else:
                    call = None
                    lane, batch, dropped = self._next_batch()
                    if not batch and self._has_work():
                        self._cond.wait(MEMORY_POLL_S)  # nothing fits now: look again soon
            if call is not None:
                run_call(*call)
                continue
            for item, error in dropped:
                fail(item, error)
            if batch and lane is not None:
                run_batch(lane, batch, (self.stats, lane.stats), self._clock)
                self._idle_owed = True

    def _has_work(self) -> bool:
        return any(lane.queue for lane in self._lanes.values())

    def _next_batch(self) -> tuple[Lane[P, R] | None, list[WorkItem[P, R]],
                                   list[tuple[WorkItem[P, R], Exception]]]:
        """The next lane's batch: the first lane in turn whose batch fits in memory now
        (a lane that does not fit must not hold up one that does)."""
        dropped: list[tuple[WorkItem[P, R], Exception]] = []
        for position, lane in enumerate(in_turn(self._lanes.values())):
            if position == 0:
                self._wait_for_window(lane)
                if not lane.queue or self._calls or self._stopping:
                    return None, [], dropped
            batch = self._take_batch(lane, dropped)
            if batch:
                lane.turn = next(self._turns)
                return lane, batch, dropped
        return None, [], dropped

    def _wait_for_window(self, lane: Lane[P, R]) -> None:
        """With a window configured, let the batch fill until FIRST arrival + window."""
        if self._max_wait_s <= 0:
            return
        close_at = lane.queue[0].enqueued_at + self._max_wait_s
        while (lane.queue and len(lane.queue) < lane.max_batch and not self._stopping
               and not self._calls):
            remaining = close_at - self._clock()
            if remaining <= 0:
                return
            self._cond.wait(remaining)

    def _take_batch(self, lane: Lane[P, R],
                    dropped: list[tuple[WorkItem[P, R], Exception]]) -> list[WorkItem[P, R]]:
        def expired() -> Exception:
            return DeadlineExceeded("vramguard could not get to this image in time because it "
                                    "is busy. Try again shortly.",
                                    retry_after=self.retry_after(lane.name))

        return lane.take_batch(self._clock(), self._counted, expired, dropped)

    def _counted(self, lane: Lane[P, R], counter: str) -> None:
        for stats in (self.stats, lane.stats):
            setattr(stats, counter, getattr(stats, counter) + 1)
