"""The device thread's turns between models' lanes, on a fake clock: a flood of requests
for one model never delays another model's next batch by more than one batch of it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from app.engine.batcher import MicroBatcher
from app.errors import Overloaded

BATCH_S = 0.1  # fake seconds every batch takes


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self.lock:
            self.now += seconds


class Device:
    """Each lane's model: records (lane, size, start time) and takes BATCH_S fake seconds;
    ``hold`` stops the first batch until released, so work can pile up meanwhile."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.batches: list[tuple[str, int, float]] = []
        self.hold = threading.Event()
        self.held = threading.Event()
        self.hold.set()

    def model(self, lane: str):  # type: ignore[no-untyped-def]
        def run(items: list[int]) -> list[int]:
            self.batches.append((lane, len(items), self.clock()))
            self.held.set()
            self.hold.wait(10)
            self.clock.advance(BATCH_S)
            return items

        return run


@pytest.fixture
def setup() -> Iterator[tuple[MicroBatcher[int, int], Device, Clock]]:
    clock = Clock()
    device = Device(clock)
    batcher: MicroBatcher[int, int] = MicroBatcher(queue_size=1000, clock=clock)
    for lane in ("flood", "trickle", "third"):
        batcher.add_lane(lane, device.model(lane), max_batch=4)
    batcher.start()
    yield batcher, device, clock
    batcher.stop()


def test_a_trickle_waits_for_at_most_one_batch_of_a_flood(setup) -> None:  # type: ignore[no-untyped-def]
    batcher, device, clock = setup
    device.hold.clear()
    flood = [batcher.submit(i, 60, lane="flood") for i in range(40)]
    assert device.held.wait(10)  # the flood's first batch is running
    submitted_at = clock()
    trickle = batcher.submit(1, 60, lane="trickle")
    flood += [batcher.submit(i, 60, lane="flood") for i in range(40)]  # it keeps coming
    device.hold.set()
    assert trickle.result(10) == 1
    for future in flood:
        future.result(10)
    started = next(t for lane, _, t in device.batches if lane == "trickle")
    flood_before = [t for lane, _, t in device.batches if lane == "flood" and t < started]
    assert len(flood_before) == 1  # only the batch that was already running
    assert started - submitted_at <= BATCH_S + 1e-9  # within one batch of the flood


def test_busy_lanes_take_turns(setup) -> None:  # type: ignore[no-untyped-def]
    batcher, device, _clock = setup
    device.hold.clear()
    first = batcher.submit(0, 60, lane="flood")
    assert device.held.wait(10)
    futures = [batcher.submit(i, 60, lane=lane) for lane in ("flood", "trickle", "third")
               for i in range(12)]
    device.hold.set()
    first.result(10)
    for future in futures:
        future.result(10)
    order = [lane for lane, _, _ in device.batches[1:]]
    assert order == ["trickle", "third", "flood"] * 3
    assert all(size == 4 for _, size, _ in device.batches[1:])


def test_admission_counts_only_the_turns_of_other_lanes_ahead(setup) -> None:  # type: ignore[no-untyped-def]
    """41 flood images ahead at 10 ms each would be 0.41 s in one queue; a trickle request
    waits only for the flood's batch of 4 in progress (turns alternate), so it is admitted
    within 0.2 s where a flood request is not."""
    batcher, device, _clock = setup
    batcher.set_service_rate(100.0, "flood")
    batcher.set_service_rate(100.0, "trickle")
    device.hold.clear()
    flood = [batcher.submit(i, 60, lane="flood") for i in range(41)]
    assert device.held.wait(10)
    assert batcher.predicted_wait("trickle") == pytest.approx(4 * 0.01)
    assert batcher.predicted_wait("flood") == pytest.approx(41 * 0.01)
    with batcher.reserve(0.2, "trickle"):
        pass
    with pytest.raises(Overloaded):
        batcher.reserve(0.2, "flood")
    device.hold.set()
    for future in flood:
        future.result(10)


def test_a_removed_lane_fails_its_queue_and_refuses_new_work(setup) -> None:  # type: ignore[no-untyped-def]
    batcher, device, _clock = setup
    device.hold.clear()
    running = batcher.submit(0, 60, lane="flood")
    assert device.held.wait(10)
    queued = batcher.submit(1, 60, lane="trickle")
    place = batcher.reserve(60, "trickle")
    batcher.remove_lane("trickle", Overloaded("unloaded", retry_after=1))
    with pytest.raises(Overloaded, match="unloaded"):
        queued.result(10)
    with pytest.raises(Overloaded, match="unloaded while"):
        batcher.submit(2, 60, place, lane="trickle")
    device.hold.set()
    assert running.result(10) == 0
