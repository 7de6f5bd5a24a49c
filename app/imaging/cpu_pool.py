"""The bounded CPU pool for decoding, preprocessing, hashing and cache I/O.

Sized from the physical core count, with one slot per worker: a flood waits
for a slot here (cheaply, on the event loop) instead of piling work into the
executor's unbounded queue. Waiting is bounded too: when the measured job time
says a new job could not start before its deadline (or too many already wait),
the answer is an immediate 503, and a job whose deadline passes while it waits
gets 503 without running.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

import psutil

from app.errors import Overloaded, too_busy_to_start

P = ParamSpec("P")
T = TypeVar("T")


def physical_cores() -> int:
    """Physical cores (hyper-threads share one core's decoder throughput)."""
    return psutil.cpu_count(logical=False) or psutil.cpu_count() or 1


class CpuPool:
    """One slot per worker thread: a job waits for its slot on the event loop, where its
    deadline applies, never in the executor's own queue behind busy workers."""

    def __init__(self, workers: int | None = None, max_waiting: int = 256) -> None:
        self.workers = workers or physical_cores()
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="vramguard-cpu")
        self._slots = asyncio.Semaphore(self.workers)
        self.max_waiting = max_waiting
        self.waiting = 0
        self.mean_job_s = 0.0  # moving average of job durations, for wait predictions

    def predicted_wait(self) -> float:
        """Seconds a job submitted now would wait for a worker."""
        return (self.waiting + 1) * self.mean_job_s / self.workers

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn`` on a worker as soon as one is free (no deadline)."""
        await self._slots.acquire()
        return await self._start(fn, *args, **kwargs)

    async def run_before(self, deadline: float, fn: Callable[P, T], *args: P.args,
                         **kwargs: P.kwargs) -> T:
        """Like ``run``, but refuse at once (Overloaded) when too many jobs already wait
        for a worker, and give up (DeadlineExceeded) if none frees before ``deadline``
        (time.monotonic). A job that has started always finishes."""
        if self._slots.locked() and (self.waiting >= self.max_waiting or
                                     self.predicted_wait() > deadline - time.monotonic()):
            raise Overloaded("vramguard is busy: too many images are waiting to be opened. "
                             "Try again shortly.", retry_after=max(1.0, self.predicted_wait()))
        self.waiting += 1
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await self._slots.acquire()
        except TimeoutError:
            raise too_busy_to_start() from None
        finally:
            self.waiting -= 1
        return await self._start(fn, *args, **kwargs)

    async def _start(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn`` in the slot just acquired; the slot is freed when the job ends, even
        if its caller stopped waiting for it first."""
        loop = asyncio.get_running_loop()
        started = time.monotonic()

        def finished(_: object) -> None:
            took = time.monotonic() - started
            self.mean_job_s = took if not self.mean_job_s else 0.9 * self.mean_job_s + 0.1 * took
            self._slots.release()

        try:
            job = self._executor.submit(functools.partial(fn, *args, **kwargs))
        except BaseException:
            self._slots.release()
            raise
        job.add_done_callback(lambda done: loop.call_soon_threadsafe(finished, done))
        return await asyncio.wrap_future(job)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
