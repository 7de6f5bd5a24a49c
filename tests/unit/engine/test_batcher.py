"""The micro-batcher with a fake model function: dispatch, accumulation, window, drops."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, wait
from types import SimpleNamespace

import pytest

from app.engine import batcher as batcher_module
from app.engine.batcher import MicroBatcher
from app.errors import DeadlineExceeded, Overloaded


class FakeClock:
    """Virtual time: it moves only when the test advances it or the batcher sleeps.

    Passed as the batcher's ``clock`` and, through ``fake_clock``, as its module's
    ``time`` - so any delay the batcher adds, timed or slept, shows up as a start time
    later than the submit time instead of as a wall-clock bound.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr(batcher_module, "time", SimpleNamespace(monotonic=clock,
                                                                sleep=clock.sleep))
    return clock


class FakeModel:
    """Records every batch; can be held busy with a gate to make requests pile up."""

    def __init__(self, fail_on: object = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.batches: list[list[object]] = []
        self.started: list[float] = []
        self.threads: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail_on = fail_on

    def __call__(self, items: list[object]) -> list[object]:
        self.started.append(self.clock())
        self.threads.add(threading.current_thread().name)
        self.batches.append(list(items))
        self.entered.set()
        self.gate.wait(10)
        if self.fail_on in items:
            raise RuntimeError("model exploded")
        return [f"out:{item}" for item in items]


@pytest.fixture
def make():
    made: list[MicroBatcher] = []

    def factory(model: FakeModel, **kwargs) -> MicroBatcher:
        kwargs.setdefault("max_batch", 4)
        batcher = MicroBatcher(model, **kwargs)
        batcher.start()
        made.append(batcher)
        return batcher

    yield factory
    for batcher in made:
        batcher.stop()


def hold_busy(model: FakeModel, batcher: MicroBatcher) -> Future:
    """Occupy the device with one request and return its future once it is running."""
    model.gate.clear()
    model.entered.clear()
    blocker = batcher.submit("blocker", timeout_s=30)
    assert model.entered.wait(5)
    return blocker


def test_idle_device_dispatches_at_once(make, fake_clock):
    model = FakeModel(clock=fake_clock)
    batcher = make(model, max_batch=8, clock=fake_clock)  # no wait window
    submitted_at = fake_clock()
    assert batcher.submit("a", timeout_s=5).result(5) == "out:a"
    assert model.batches == [["a"]]
    # Virtual time stands still unless the batcher waits or sleeps: an idle device
    # starts the batch at the very instant it was submitted.
    assert model.started == [submitted_at]


def test_requests_accumulate_while_busy_and_flush_on_size(make):
    model = FakeModel()
    batcher = make(model, max_batch=3)
    blocker = hold_busy(model, batcher)
    futures = [batcher.submit(i, timeout_s=30) for i in range(5)]
    assert batcher.queue_depth == 5
    model.gate.set()
    assert [f.result(5) for f in futures] == [f"out:{i}" for i in range(5)]
    assert blocker.result(5) == "out:blocker"
    assert model.batches == [["blocker"], [0, 1, 2], [3, 4]]
    assert batcher.stats.largest_batch == 3
    assert batcher.stats.batches == 3 and batcher.stats.items == 6


def test_one_thread_runs_every_batch_and_call(make):
    model = FakeModel()
    batcher = make(model, max_batch=2)
    futures = [batcher.submit(i, timeout_s=5) for i in range(6)]
    wait(futures, timeout=5)
    name = batcher.call(lambda: threading.current_thread().name).result(5)
    assert model.threads == {name} == {batcher.thread.name}


def test_window_counts_from_first_arrival(make):
    model = FakeModel()
    window = 0.4
    batcher = make(model, max_batch=8, max_wait_s=window)
    first_at = time.monotonic()
    first = batcher.submit("first", timeout_s=10)
    time.sleep(0.3)
    second = batcher.submit("second", timeout_s=10)
    assert first.result(5) == "out:first" and second.result(5) == "out:second"
    assert model.batches == [["first", "second"]]
    # Counted from the second arrival it would close at 0.7 s; from the first, at 0.4 s.
    waited = model.started[0] - first_at
    assert window - 0.01 <= waited < 0.3 + window


def test_window_counts_from_first_arrival_while_the_device_is_busy(make, fake_clock):
    """Requests that queued up behind a batch running longer than the window have had
    their window already: when the device frees, their batch starts at once."""
    window = 0.05  # virtual seconds; also how often (in real seconds) the device re-looks
    model = FakeModel(clock=fake_clock)
    batcher = make(model, max_batch=8, max_wait_s=window, clock=fake_clock)
    model.gate.clear()
    blocker = batcher.submit("blocker", timeout_s=60)
    fake_clock.advance(window)  # the blocker's own window closes
    assert model.entered.wait(5)
    model.entered.clear()
    queued = [batcher.submit(i, timeout_s=60) for i in range(2)]
    fake_clock.advance(10 * window)  # the device stays busy far longer than the window
    freed_at = fake_clock()
    model.gate.set()
    assert blocker.result(5) == "out:blocker"
    # Virtual time no longer moves, so a window counted from when the device thread
    # looks (freed_at + window) would never close and this batch would never start.
    assert model.entered.wait(5), "the queued batch did not start when the device freed"
    assert [f.result(5) for f in queued] == ["out:0", "out:1"]
    assert model.batches == [["blocker"], [0, 1]]
    assert model.started[1] == freed_at


def test_window_closes_early_when_batch_is_full(make):
    model = FakeModel()
    batcher = make(model, max_batch=2, max_wait_s=30)
    futures = [batcher.submit(i, timeout_s=60) for i in range(2)]
    assert [f.result(5) for f in futures] == ["out:0", "out:1"]


def test_expired_requests_are_dropped_not_computed(make):
    model = FakeModel()
    batcher = make(model, max_batch=4)
    hold_busy(model, batcher)
    stale = batcher.submit("stale", timeout_s=0.05)
    fresh = batcher.submit("fresh", timeout_s=30)
    time.sleep(0.15)
    model.gate.set()
    with pytest.raises(DeadlineExceeded) as info:
        stale.result(5)
    assert info.value.retry_after is not None
    assert fresh.result(5) == "out:fresh"
    assert all("stale" not in batch for batch in model.batches)
    assert batcher.stats.expired == 1


def test_requests_expire_while_nothing_fits_in_memory(make, fake_clock):
    """With the memory guard allowing no batch at all, a request still gets its
    DeadlineExceeded when its deadline passes, and the model never sees it."""
    model = FakeModel(clock=fake_clock)
    batcher = make(model, max_batch=4, clock=fake_clock, batch_limit=lambda: 0)
    waiting = batcher.submit("waiting", timeout_s=1.0)
    fake_clock.advance(2.0)  # past its deadline; the device re-looks every MEMORY_POLL_S
    with pytest.raises(DeadlineExceeded) as info:
        waiting.result(5)
    assert info.value.retry_after is not None
    assert model.batches == []
    assert batcher.stats.expired == 1 and batcher.stats.batches == 0


def test_work_that_would_answer_after_its_deadline_is_not_started(make, fake_clock):
    """The deadline is a promise about when the answer arrives: at 0.1 s per image, a
    request with 0.05 s left when the device frees is refused, not computed late."""
    model = FakeModel(clock=fake_clock)
    batcher = make(model, max_batch=4, clock=fake_clock)
    batcher.set_service_rate(10.0)  # 0.1 s per image
    hold_busy(model, batcher)
    late = batcher.submit("late", timeout_s=1.0)
    in_time = batcher.submit("in time", timeout_s=5.0)
    fake_clock.advance(0.95)  # "late" now has 0.05 s left, "in time" 4.05 s
    model.gate.set()
    with pytest.raises(DeadlineExceeded):
        late.result(5)
    assert in_time.result(5) == "out:in time"
    assert all("late" not in batch for batch in model.batches)


def test_cancelled_requests_are_withdrawn(make):
    model = FakeModel()
    batcher = make(model, max_batch=4)
    hold_busy(model, batcher)
    gone = batcher.submit("gone", timeout_s=30)
    kept = batcher.submit("kept", timeout_s=30)
    assert gone.cancel()
    model.gate.set()
    assert kept.result(5) == "out:kept"
    with pytest.raises(CancelledError):
        gone.result(0)
    assert all("gone" not in batch for batch in model.batches)
    assert batcher.stats.cancelled == 1


def test_cancelling_the_awaiting_task_withdraws_the_request(make):
    model = FakeModel()
    batcher = make(model, max_batch=4)

    async def scenario() -> None:
        hold_busy(model, batcher)
        task = asyncio.ensure_future(batcher.infer("client-left", timeout_s=30))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        model.gate.set()
        assert await batcher.infer("next", timeout_s=30) == "out:next"

    asyncio.run(scenario())
    assert all("client-left" not in batch for batch in model.batches)


def test_exception_reaches_only_its_batch(make):
    model = FakeModel(fail_on="bad")
    batcher = make(model, max_batch=2)
    hold_busy(model, batcher)
    doomed = [batcher.submit("bad", timeout_s=30), batcher.submit("x", timeout_s=30)]
    spared = [batcher.submit("y", timeout_s=30), batcher.submit("z", timeout_s=30)]
    model.gate.set()
    for future in doomed:
        with pytest.raises(RuntimeError, match="model exploded"):
            future.result(5)
    assert [f.result(5) for f in spared] == ["out:y", "out:z"]
    assert batcher.submit("after", timeout_s=5).result(5) == "out:after"
    assert batcher.stats.failed_batches == 1


def test_a_batch_is_counted_before_its_answers_go_out(make):
    """A client that reads /v1/stats right after its answer finds its batch counted
    (the stats were counted after the futures were settled, and a loaded machine showed
    the answer first)."""
    model = FakeModel(fail_on="bad")
    batcher = make(model, max_batch=2)
    seen: list[tuple[int, int]] = []

    def record(_: Future) -> None:  # runs as the answer is given, on the device thread
        seen.append((batcher.stats.batches, batcher.stats.failed_batches))

    hold_busy(model, batcher)
    good = batcher.submit("x", timeout_s=30)
    good.add_done_callback(record)
    model.gate.set()
    assert good.result(5) == "out:x"
    bad = batcher.submit("bad", timeout_s=30)
    bad.add_done_callback(record)
    with pytest.raises(RuntimeError, match="model exploded"):
        bad.result(5)
    assert seen == [(2, 0), (3, 1)]


def test_full_queue_refuses_with_retry_after(make):
    model = FakeModel()
    batcher = make(model, max_batch=1, queue_size=2)
    batcher.set_service_rate(0.5)
    hold_busy(model, batcher)
    batcher.submit(1, timeout_s=30)
    batcher.submit(2, timeout_s=30)
    with pytest.raises(Overloaded) as info:
        batcher.submit(3, timeout_s=30)
    assert info.value.status == 503
    # two queued + one running at 2 s per image
    assert info.value.headers() == {"Retry-After": "6"}
    model.gate.set()


def test_stop_fails_queued_requests_and_refuses_new_ones(make):
    model = FakeModel()
    batcher = make(model, max_batch=1)
    running = hold_busy(model, batcher)
    queued = batcher.submit("queued", timeout_s=30)
    stopper = threading.Thread(target=batcher.stop)
    stopper.start()
    assert isinstance(queued.exception(5), Overloaded)
    with pytest.raises(Overloaded):
        batcher.submit("late", timeout_s=5)
    model.gate.set()
    stopper.join(5)
    assert running.result(5) == "out:blocker"
    assert not batcher.thread.is_alive()


def test_a_wait_longer_than_the_deadline_is_refused_at_once(make):
    model = FakeModel()
    batcher = make(model, max_batch=1, queue_size=100)
    batcher.set_service_rate(2.0)  # half a second per image
    hold_busy(model, batcher)
    accepted = [batcher.submit(i, timeout_s=2.0) for i in range(3)]  # waits 0.5, 1.0, 1.5 s
    with pytest.raises(Overloaded) as info:
        batcher.submit("late", timeout_s=2.0)  # would wait 2.0 s: not within its deadline
    assert info.value.headers() == {"Retry-After": "2"}
    assert batcher.submit("patient", timeout_s=10.0) is not None  # a longer deadline fits
    model.gate.set()
    assert [f.result(5) for f in accepted] == ["out:0", "out:1", "out:2"]


def test_reserved_places_count_ahead_and_refuse_before_the_image_is_read(make):
    model = FakeModel()
    batcher = make(model, max_batch=1, queue_size=100)
    batcher.set_service_rate(2.0)  # half a second per image
    hold_busy(model, batcher)
    # Admitted within 0.8 x 4 s = 3.2 s: the running one, then 0.5 s per reserved place.
    places = [batcher.reserve(timeout_s=4.0) for _ in range(5)]  # answers due by 1.0 ... 3.0 s
    assert batcher.predicted_wait() == pytest.approx(3.0)
    with pytest.raises(Overloaded) as info:
        batcher.reserve(timeout_s=4.0)  # due by 3.5 s: past the admission share
    assert info.value.status == 503 and info.value.retry_after == pytest.approx(3.0)
    with places[0]:
        pass  # a request that never got to the queue gives its place back
    assert batcher.reserved == 4 and batcher.reserve(timeout_s=4.0).held
    model.gate.set()


def test_a_reserved_place_becomes_a_queued_item_once(make):
    model = FakeModel()
    batcher = make(model, max_batch=1, queue_size=2)
    blocker = hold_busy(model, batcher)
    with batcher.reserve(timeout_s=30) as place, batcher.reserve(timeout_s=30):
        with pytest.raises(Overloaded):  # two places kept: the queue is full
            batcher.submit("unreserved", timeout_s=30)
        queued = batcher.submit("reserved", timeout_s=30, reservation=place)
        assert batcher.reserved == 1 and batcher.queue_depth == 1
    assert batcher.reserved == 0  # leaving the block does not give the used place back twice
    model.gate.set()
    assert blocker.result(5) == "out:blocker" and queued.result(5) == "out:reserved"


def test_the_service_rate_follows_what_batches_take(make, fake_clock):
    class SlowModel(FakeModel):
        def __call__(self, items: list[object]) -> list[object]:
            fake_clock.advance(0.2 * len(items))  # 0.2 s per image, 4x warmup's promise
            return super().__call__(items)

    batcher = make(SlowModel(clock=fake_clock), max_batch=1, clock=fake_clock)
    batcher.set_service_rate(20.0)  # warmup, measured alone: 0.05 s per image
    for i in range(20):
        assert batcher.submit(i, timeout_s=30).result(5) == f"out:{i}"
    assert batcher.seconds_per_item == pytest.approx(0.2, rel=0.02)


def test_one_stalled_batch_does_not_swing_the_service_rate(make, fake_clock):
    took = iter([0.05] * 10 + [5.0] + [0.05] * 3)  # one batch stalls for 5 s

    class StallingModel(FakeModel):
        def __call__(self, items: list[object]) -> list[object]:
            fake_clock.advance(next(took))
            return super().__call__(items)

    batcher = make(StallingModel(clock=fake_clock), max_batch=1, clock=fake_clock)
    batcher.set_service_rate(20.0)
    for i in range(14):
        batcher.submit(i, timeout_s=30).result(5)
    assert batcher.seconds_per_item == pytest.approx(0.05)


def test_lone_images_do_not_set_the_rate_a_backlog_is_served_at(make, fake_clock):
    class SlowAlone(FakeModel):
        def __call__(self, items: list[object]) -> list[object]:
            fake_clock.advance(0.1 * len(items) if len(items) == 4 else 0.3)
            return super().__call__(items)

    batcher = make(SlowAlone(clock=fake_clock), max_batch=4, clock=fake_clock)
    batcher.set_service_rate(10.0)  # warmup: 0.1 s per image in batches of 4
    for i in range(5):  # one at a time: batches of 1, 0.3 s each
        assert batcher.submit(i, timeout_s=30).result(5) == f"out:{i}"
    assert batcher.seconds_per_item == pytest.approx(0.1)


def test_background_steps_alternate_with_batches_and_give_way_to_calls() -> None:
    """Queued before the device thread starts: the call first (calls go before all else),
    then a batch (work was waiting), and steps alternate with batches under load."""
    order: list[str] = []
    batcher: MicroBatcher[int, int] = MicroBatcher(
        lambda items: [order.append(f"batch {items[0]}") or i for i in items], max_batch=1)
    items = [batcher.submit(n, 60) for n in range(3)]
    steps = [batcher.when_idle(lambda n=n: order.append(f"step {n}")) for n in range(3)]
    called = batcher.call(lambda: order.append("call"))
    batcher.start()
    try:
        wait([*items, *steps, called], timeout=60)
    finally:
        batcher.stop()
    assert order == ["call", "batch 0", "step 0", "batch 1", "step 1", "batch 2", "step 2"]


def test_a_failed_background_step_fails_its_future_only() -> None:
    batcher: MicroBatcher[int, int] = MicroBatcher(lambda items: items)
    batcher.start()
    try:
        failed = batcher.when_idle(lambda: 1 / 0)
        assert isinstance(failed.exception(60), ZeroDivisionError)
        assert batcher.submit(7, 60).result(60) == 7
    finally:
        batcher.stop()
