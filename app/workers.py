"""The bounded CPU pool for decoding, preprocessing, hashing and cache I/O.

Sized from the physical core count; a semaphore bounds how many jobs may be
queued for it, so a flood waits here (cheaply, on the event loop) instead of
piling work into an unbounded executor queue, and the number allowed to wait
is bounded too: past it, the answer is an immediate 503.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

import psutil

from app.errors import DeadlineExceeded, Overloaded

P = ParamSpec("P")
T = TypeVar("T")


def physical_cores() -> int:
    """Physical cores (hyper-threads share one core's decoder throughput)."""
    return psutil.cpu_count(logical=False) or psutil.cpu_count() or 1


class CpuPool:
    """A thread pool with a bounded backlog; ``run`` awaits a slot, then the job."""

    def __init__(self, workers: int | None = None, backlog_per_worker: int = 4,
                 waiting_per_worker: int = 16) -> None:
        self.workers = workers or physical_cores()
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="vramguard-cpu")
        self._slots = asyncio.Semaphore(self.workers * backlog_per_worker)
        self.max_waiting = self.workers * waiting_per_worker
        self.waiting = 0

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
        if self._slots.locked() and self.waiting >= self.max_waiting:
            raise Overloaded("vramguard is busy: too many images are waiting to be opened. "
                             "Try again shortly.", retry_after=1)
        self.waiting += 1
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await self._slots.acquire()
        except TimeoutError:
            raise DeadlineExceeded("vramguard is too busy to look at this image in time. "
                                   "Try again shortly.", retry_after=2) from None
        finally:
            self.waiting -= 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor,
                                              functools.partial(fn, *args, **kwargs))
        finally:
            self._slots.release()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
