"""Goodput under overload: many clients that retry soon after every refusal.

    python -m bench.goodput [--clients 512] [--seconds 20] [--runs 3]

Each run measures, against the same server and the same large photo (2400x1600
JPEG): capacity at concurrency 32 (closed loop), then an overload of
``--clients`` clients that each resend 0.2 s after every 429 or 503 and give up
after 15 s. Goodput is 200 answers per second during the overload; the target is
at least 0.7 of capacity (median over runs), with every client answered (200, or
429/503 carrying Retry-After) inside its timeout. The server's CPU time per
answer of each kind tells what refusals cost. The naive server gets the same
overload for comparison. 127.0.0.1 only; every loop is bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from PIL import Image

from bench.loadgen import run_load
from bench.process import ROOT, free_port, running, server_env, tree_cpu_seconds
from bench.run import machine

RETRY_S = 0.2
TIMEOUT_S = 15.0
REFUSALS = ("429", "503")


def large_photo() -> bytes:
    """The test photo scaled to 2400x1600, as a phone or camera would send it."""
    with Image.open(ROOT / "tests" / "data" / "coffee.jpg") as image:
        out = io.BytesIO()
        image.convert("RGB").resize((2400, 1600)).save(out, "JPEG", quality=90)
        return out.getvalue()


@dataclass
class Overload:
    clients: int
    seconds: float
    statuses: Counter[str] = field(default_factory=Counter)
    without_retry_after: int = 0
    ok_latencies: list[float] = field(default_factory=list)
    server_cpu_s: float = 0.0

    @property
    def goodput(self) -> float:
        return self.statuses["200"] / self.seconds

    @property
    def unanswered(self) -> int:
        """Timeouts and broken connections: clients that got no answer in time."""
        return sum(n for status, n in self.statuses.items()
                   if status not in ("200", *REFUSALS) and not status.startswith("4"))


async def overload(url: str, body: bytes, clients: int, seconds: float,
                   server_pid: int) -> Overload:
    """``clients`` clients, each sending again RETRY_S after a refusal, for ``seconds``."""
    result = Overload(clients, seconds)
    deadline = time.perf_counter() + seconds
    cpu_before = tree_cpu_seconds(server_pid)

    async def client(session: aiohttp.ClientSession, index: int) -> None:
        headers = {"Content-Type": "image/jpeg", "X-Client-Id": f"app-{index}"}
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                async with session.post(url, data=body, headers=headers) as response:
                    await response.read()
                    status = str(response.status)
                    if status in REFUSALS and "Retry-After" not in response.headers:
                        result.without_retry_after += 1
            except (TimeoutError, aiohttp.ClientError) as exc:
                status = type(exc).__name__
            result.statuses[status] += 1
            if status == "200":
                result.ok_latencies.append(time.perf_counter() - started)
            else:
                await asyncio.sleep(RETRY_S)

    connector = aiohttp.TCPConnector(limit=clients, force_close=False)
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(client(session, i) for i in range(clients)))
    result.server_cpu_s = tree_cpu_seconds(server_pid) - cpu_before
    return result


def _line(name: str, capacity: float, result: Overload) -> str:
    latencies = sorted(result.ok_latencies) or [float("nan")]
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    answers = sum(result.statuses.values()) or 1
    return (f"| {name} | {capacity:.1f} | {result.goodput:.1f} | "
            f"{result.goodput / capacity if capacity else float('nan'):.2f} | "
            f"{result.statuses['200']} | {sum(result.statuses[s] for s in REFUSALS)} | "
            f"{result.unanswered} | {result.without_retry_after} | {p99:.1f} | "
            f"{result.server_cpu_s / answers * 1000:.1f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--naive", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    body = large_photo()
    work = Path(tempfile.mkdtemp(prefix="vramguard-goodput-"))
    env = server_env()
    env["VRAMGUARD_CACHE_DIR"] = str(work / "cache")
    print(f"machine: {machine()}", flush=True)
    rows = []
    servers = {"vramguard": [sys.executable, "-m", "app", "serve", "--no-cache",
                             "--log-level", "warning"],
               "naive": [sys.executable, "-m", "bench.naive_server"]}
    for name, command in servers.items():
        if name == "naive" and not args.naive:
            continue
        ratios = []
        for run in range(args.runs):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            with running([*command, "--port", str(port)], f"{url}/readyz",
                         work / f"{name}-{run}.log", env) as process:
                capacity = asyncio.run(run_load(f"{url}/v1/classify", body, 32,
                                                args.seconds / 2, process.pid))
                result = asyncio.run(overload(f"{url}/v1/classify", body, args.clients,
                                              args.seconds, process.pid))
            rate = capacity.requests_per_second
            ratios.append(result.goodput / rate if rate else 0.0)
            rows.append(_line(f"{name} run {run + 1}", rate, result))
            print(rows[-1], flush=True)
        print(f"{name}: median goodput / capacity {statistics.median(ratios):.2f}", flush=True)
    print(f"\ndate: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"{args.clients} clients, retry {RETRY_S} s after 429/503, timeout {TIMEOUT_S:.0f} s, "
          f"{args.seconds:.0f} s per overload; 2400x1600 JPEG ({len(body) // 1024} KiB)\n")
    print("| server | capacity c=32 img/s | goodput img/s | ratio | 200 | 429+503 | "
          "no answer | refusals without Retry-After | p99 of 200 s | server CPU ms "
          "per answer |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
