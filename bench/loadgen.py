"""Asynchronous load generator: N concurrent clients for a bounded time, 127.0.0.1 only.

Each client sends the next request as soon as it has its answer (closed loop).
Reports throughput, latency percentiles, status counts and the server's peak memory (PSS
of its whole process tree: shared pages counted once, split between their sharers).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
import psutil

from bench.process import own_cpu_seconds, process_tree, tree_cpu_seconds

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
# Reading a process's PSS makes the kernel walk its page tables: 22 ms of CPU for a 1.1 GiB
# torch process on the 2-core machine. Read ten times a second, that took a fifth of a core
# from the server it measured and cost it 10-25 % of its throughput; once a second costs 2 %.
PSS_EVERY_S = 1.0


@dataclass
class LoadResult:
    concurrency: int
    seconds: float
    latencies: list[float] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    peak_pss_bytes: int = 0
    server_cpu_s: float = 0.0  # the server's whole process tree, during the load
    client_cpu_s: float = 0.0  # this process (the load generator), during the load

    @property
    def ok(self) -> int:
        return self.statuses.get("200", 0)

    @property
    def requests_per_second(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]

    def merge(self, other: LoadResult) -> LoadResult:
        """Pool two runs at the same concurrency (interleaved rounds of one benchmark)."""
        return LoadResult(self.concurrency, self.seconds + other.seconds,
                          self.latencies + other.latencies, self.statuses + other.statuses,
                          max(self.peak_pss_bytes, other.peak_pss_bytes),
                          self.server_cpu_s + other.server_cpu_s,
                          self.client_cpu_s + other.client_cpu_s)

    @property
    def server_cores(self) -> float:
        """Cores the server's tree kept busy on average during the load."""
        return self.server_cpu_s / self.seconds if self.seconds else 0.0

    @property
    def client_cores(self) -> float:
        return self.client_cpu_s / self.seconds if self.seconds else 0.0

    @property
    def errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status != "200")


def tree_pss(pid: int) -> int:
    """PSS of a process and all its children (USS where the system has no PSS)."""
    total = 0
    for member in process_tree(pid):
        info = member.memory_full_info()
        total += getattr(info, "pss", info.uss)
    return total


async def _watch_memory(pid: int, result: LoadResult, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            pss = await asyncio.to_thread(tree_pss, pid)
        except psutil.Error:
            return
        result.peak_pss_bytes = max(result.peak_pss_bytes, pss)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), PSS_EVERY_S)


async def run_load(url: str, body: bytes, concurrency: int, seconds: float,
                   server_pid: int | None = None, max_requests: int = 100_000,
                   content_type: str = "image/jpeg", timeout_s: float = 60) -> LoadResult:
    """Closed-loop load on ``url`` (must be loopback) for ``seconds`` or ``max_requests``."""
    host = urlsplit(url).hostname
    if host not in LOCAL_HOSTS:
        raise ValueError(f"load tests only target this machine, not {host}")
    result = LoadResult(concurrency, seconds)
    stop = asyncio.Event()
    sent = 0
    deadline = time.perf_counter() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal sent
        while time.perf_counter() < deadline and sent < max_requests:
            sent += 1
            started = time.perf_counter()
            try:
                async with session.post(url, data=body,
                                        headers={"Content-Type": content_type}) as response:
                    await response.read()
                    status = str(response.status)
            except (TimeoutError, aiohttp.ClientError) as exc:
                status = type(exc).__name__
            result.latencies.append(time.perf_counter() - started)
            result.statuses[status] += 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        watcher = (asyncio.create_task(_watch_memory(server_pid, result, stop))
                   if server_pid else None)
        server_before = tree_cpu_seconds(server_pid) if server_pid else 0.0
        own_before = own_cpu_seconds()
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        result.seconds = time.perf_counter() - started
        result.client_cpu_s = own_cpu_seconds() - own_before
        if server_pid:
            result.server_cpu_s = tree_cpu_seconds(server_pid) - server_before
        stop.set()
        if watcher:
            await watcher
    return result
