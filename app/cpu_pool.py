"""The bounded CPU pool for decoding, preprocessing, hashing and cache I/O.

Sized from the physical core count; a semaphore bounds how many jobs may be
queued for it, so a flood waits here (cheaply, on the event loop) instead of
piling work into an unbounded executor queue. Waiting is bounded too: when
the measured job time says a new job could not start before its deadline (or
too many already wait), the answer is an immediate 503.
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
    """A thread pool with a bounded backlog; ``run`` awaits a slot, then the job."""

    def __init__(self, workers: int | None = None, backlog_per_worker: int = 4,
                 max_waiting: int = 256) -> None:
        self.workers = workers or physical_cores()
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="vramguard-cpu")
        self._slots = asyncio.Semaphore(self.workers * backlog_per_worker)
        self.max_waiting = max_waiting
        self.waiting = 0
        self.mean_job_s = 0.0  # moving average of job durations, for wait predictions

    def predicted_wait(self) -> float:
        """Seconds a job submitted now would wait for a worker."""
        return (self.waiting + 1) * self.mean_job_s / self.workers

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        async with self._slots:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor,
                                              functools.partial(fn, *args, **kwargs))

    async def run_before(self, deadline: float, fn: Callable[P, T], *args: P.args,
                         **kwargs: P.kwargs) -> T:
        """Like ``run``, but refuse at once (Overloaded) when too many jobs already wait
        for a slot, and give up (DeadlineExceeded) if none frees before ``deadline``
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
        started = time.monotonic()
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor,
                                              functools.partial(fn, *args, **kwargs))
        finally:
            self._slots.release()
            took = time.monotonic() - started
            self.mean_job_s = took if not self.mean_job_s else 0.9 * self.mean_job_s + 0.1 * took

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
