"""The CPU pool's admission rules: refuse at once when too many wait or the predicted wait
passes the deadline, give up when no slot frees in time, and never abandon a started job.

Workers are held busy by jobs that block on a threading.Event; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
from asgi import until

from app.errors import DeadlineExceeded, Overloaded
from app.imaging.cpu_pool import CpuPool

pytestmark = pytest.mark.anyio
FAR = 60.0  # seconds: a deadline no test reaches
BOUND = 5.0  # seconds: the longest any single wait in these tests may take


class Blocker:
    """A job that holds its worker until released; says when it started and finished."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.finished = threading.Event()

    def __call__(self, value: str) -> str:
        self.started.set()
        if not self.release.wait(BOUND):
            raise TimeoutError("the test never released this job")
        self.finished.set()
        return value


class Pools:
    """Makes pools and blockers; afterwards releases every blocker, then shuts pools down."""

    def __init__(self) -> None:
        self.pools: list[CpuPool] = []
        self.blockers: list[Blocker] = []

    def pool(self, workers: int = 1, max_waiting: int = 100) -> CpuPool:
        pool = CpuPool(workers, max_waiting=max_waiting)
        self.pools.append(pool)
        return pool

    def blocker(self) -> Blocker:
        self.blockers.append(Blocker())
        return self.blockers[-1]

    def close(self) -> None:
        for blocker in self.blockers:
            blocker.release.set()
        for pool in self.pools:
            pool.shutdown()


@pytest.fixture
def pools() -> Iterator[Pools]:
    made = Pools()
    try:
        yield made
    finally:
        made.close()


def deadline(seconds: float) -> float:
    return time.monotonic() + seconds


async def occupy(pool: CpuPool, blocker: Blocker) -> asyncio.Future[str]:
    """Start ``blocker`` on ``pool`` and wait (bounded) until it runs on a worker."""
    job = asyncio.ensure_future(pool.run_before(deadline(FAR), blocker, "blocker"))
    await until(blocker.started.is_set)
    return job


async def measure(pool: CpuPool, seconds: float) -> None:
    """Give the pool a measured job time of at least ``seconds``."""
    await pool.run_before(deadline(FAR), time.sleep, seconds)
    assert pool.mean_job_s >= seconds


def ran(log: list[str], name: str) -> str:
    log.append(name)
    return name


async def test_a_job_runs_on_a_worker_thread_and_is_timed(pools: Pools) -> None:
    pool = pools.pool(workers=2)
    name = await pool.run_before(deadline(FAR), lambda: threading.current_thread().name)
    assert name.startswith("vramguard-cpu") and name != threading.current_thread().name
    assert pool.mean_job_s > 0 and pool.waiting == 0
    assert await pool.run(sum, [1, 2, 3]) == 6


async def test_too_many_waiting_is_refused_at_once(pools: Pools) -> None:
    pool = pools.pool(workers=1, max_waiting=2)
    blocker = pools.blocker()
    running = await occupy(pool, blocker)
    log: list[str] = []
    waiters = [asyncio.ensure_future(pool.run_before(deadline(FAR), ran, log, f"w{i}"))
               for i in range(2)]
    await until(lambda: pool.waiting == 2)

    with pytest.raises(Overloaded) as refused:
        await asyncio.wait_for(pool.run_before(deadline(FAR), ran, log, "refused"), BOUND)
    assert refused.value.status == 503 and refused.value.code == "overloaded"
    assert refused.value.headers() == {"Retry-After": "1"}
    assert pool.waiting == 2

    blocker.release.set()
    assert await asyncio.wait_for(running, BOUND) == "blocker"
    assert await asyncio.wait_for(asyncio.gather(*waiters), BOUND) == ["w0", "w1"]
    assert log == ["w0", "w1"] and pool.waiting == 0


async def test_a_predicted_wait_past_the_deadline_is_refused_at_once(pools: Pools) -> None:
    pool = pools.pool(workers=1)
    await measure(pool, 0.2)
    blocker = pools.blocker()
    running = await occupy(pool, blocker)
    log: list[str] = []

    with pytest.raises(Overloaded) as refused:  # about 0.2 s to wait, 0.05 s left
        await asyncio.wait_for(pool.run_before(deadline(0.05), ran, log, "late"), BOUND)
    assert int(refused.value.headers()["Retry-After"]) >= 1
    assert pool.waiting == 0

    patient = asyncio.ensure_future(pool.run_before(deadline(FAR), ran, log, "patient"))
    await until(lambda: pool.waiting == 1)  # it waits: its deadline allows for the wait
    blocker.release.set()
    assert await asyncio.wait_for(patient, BOUND) == "patient"
    assert await asyncio.wait_for(running, BOUND) == "blocker"
    assert log == ["patient"]


async def test_with_a_free_slot_a_job_is_not_refused_for_its_prediction(pools: Pools) -> None:
    pool = pools.pool(workers=1)
    await measure(pool, 0.1)
    assert await pool.run_before(deadline(0.01), str, "idle pool") == "idle pool"


async def test_no_slot_before_the_deadline_is_deadline_exceeded(pools: Pools) -> None:
    pool = pools.pool(workers=1)  # no job measured: predicts no wait
    blocker = pools.blocker()
    running = await occupy(pool, blocker)
    log: list[str] = []

    with pytest.raises(DeadlineExceeded) as late:
        await asyncio.wait_for(pool.run_before(deadline(0.1), ran, log, "late"), BOUND)
    assert late.value.status == 503 and late.value.code == "deadline_exceeded"
    assert late.value.headers() == {"Retry-After": "2"}
    assert pool.waiting == 0 and log == [] and not blocker.finished.is_set()

    blocker.release.set()
    assert await asyncio.wait_for(running, BOUND) == "blocker"
    # The waiter that gave up took no slot with it.
    assert await asyncio.wait_for(pool.run_before(deadline(FAR), ran, log, "next"),
                                  BOUND) == "next"


async def test_a_started_job_finishes_after_its_deadline(pools: Pools) -> None:
    pool = pools.pool(workers=1)
    blocker = pools.blocker()
    due = deadline(0.05)
    job = asyncio.ensure_future(pool.run_before(due, blocker, "done anyway"))
    await until(blocker.started.is_set)
    await until(lambda: time.monotonic() > due)
    blocker.release.set()
    assert await asyncio.wait_for(job, BOUND) == "done anyway"


async def test_a_started_job_finishes_when_its_caller_is_cancelled(pools: Pools) -> None:
    pool = pools.pool(workers=1)
    blocker = pools.blocker()
    job = await occupy(pool, blocker)
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await job
    blocker.release.set()
    assert await asyncio.to_thread(blocker.finished.wait, BOUND)


async def test_a_cancelled_waiter_leaves_the_count(pools: Pools) -> None:
    pool = pools.pool(workers=1, max_waiting=1)
    blocker = pools.blocker()
    running = await occupy(pool, blocker)
    log: list[str] = []
    waiter = asyncio.ensure_future(pool.run_before(deadline(FAR), ran, log, "gone"))
    await until(lambda: pool.waiting == 1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert pool.waiting == 0
    second = asyncio.ensure_future(pool.run_before(deadline(FAR), ran, log, "second"))
    await until(lambda: pool.waiting == 1)  # admitted: the cancelled one left its place
    blocker.release.set()
    assert await asyncio.wait_for(second, BOUND) == "second"
    assert await asyncio.wait_for(running, BOUND) == "blocker"
    assert log == ["second"]


async def test_a_job_queued_behind_a_busy_worker_is_refused_by_its_deadline(
        pools: Pools) -> None:
    pool = pools.pool(workers=1)
    await measure(pool, 0.2)
    blocker = pools.blocker()
    running = await occupy(pool, blocker)  # the only worker, indefinitely
    log: list[str] = []
    try:
        with pytest.raises((Overloaded, DeadlineExceeded)):  # about 0.2 s to wait, 0.05 left
            await asyncio.wait_for(pool.run_before(deadline(0.05), ran, log, "late"), 0.5)
    finally:
        blocker.release.set()
        await asyncio.wait_for(running, BOUND)
    assert log == []


async def test_a_cancelled_caller_keeps_its_slot_until_the_job_ends(pools: Pools) -> None:
    pool = pools.pool(workers=1)
    blocker = pools.blocker()
    running = await occupy(pool, blocker)
    running.cancel()
    await asyncio.sleep(0)
    log: list[str] = []
    with pytest.raises(DeadlineExceeded):  # the worker is still busy: no slot to be had
        await pool.run_before(deadline(0.1), ran, log, "late")
    blocker.release.set()
    await until(blocker.finished.is_set)
    assert await asyncio.wait_for(pool.run_before(deadline(FAR), ran, log, "next"), BOUND) == "next"
    assert log == ["next"]
