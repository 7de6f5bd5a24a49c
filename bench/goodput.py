"""Goodput under overload: many clients that retry soon after every refusal.

    python -m bench.goodput [--clients 512] [--seconds 20] [--runs 3]
                            [--styles kept-alive new-connection]

Each run measures, against the same server and the same large photo (2400x1600
JPEG): capacity at concurrency 32 (closed loop), then an overload of
``--clients`` clients that each resend 0.2 s after every 429 or 503 and give up
after 15 s. Goodput is 200 answers per second during the overload; the target is
at least 0.7 of capacity (median over runs), with every client answered (200, or
429/503 carrying Retry-After) inside its timeout. The server's CPU time per
answer tells what refusals cost, and the clients' own share of the cores is
stated beside it: they run on the same computer. The naive server gets the same
overload for comparison. 127.0.0.1 only; every loop is bounded in time.

Two client styles, both found on desktops:

- **kept-alive**: aiohttp in one event loop, connections reused;
- **new-connection**: a thread per client that opens a new connection for every
  attempt and writes its whole body before reading the answer (``http.client``, as
  ``requests`` and many other libraries do).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import io
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from PIL import Image

from bench.loadgen import run_load
from bench.process import (
    ROOT,
    free_port,
    own_cpu_seconds,
    running,
    server_env,
    tree_cpu_seconds,
)
from bench.run import machine

RETRY_S = 0.2
TIMEOUT_S = 15.0
REFUSALS = ("429", "503")
STYLES = ("kept-alive", "new-connection")


def post_on_new_connection(url: str, body: bytes, headers: dict[str, str],
                           timeout_s: float) -> tuple[str, bool]:
    """One POST of ``body`` on a connection of its own, written whole before the answer is
    read: the status (or the error's name) and whether a refusal lacked Retry-After."""
    address, _, path = url.removeprefix("http://").partition("/")
    host, _, port = address.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        connection.request("POST", "/" + path, body=body, headers=headers)
        response = connection.getresponse()
        response.read()
        status = str(response.status)
        return status, status in REFUSALS and response.getheader("Retry-After") is None
    except (OSError, http.client.HTTPException) as exc:
        return type(exc).__name__, False
    finally:
        connection.close()


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
    client_cpu_s: float = 0.0

    @property
    def goodput(self) -> float:
        return self.statuses["200"] / self.seconds

    @property
    def no_answer_kinds(self) -> str:
        """What the clients without an answer got instead (an error's name, "late")."""
        return ", ".join(f"{n} x {status}" for status, n in self.statuses.items()
                         if status not in ("200", *REFUSALS) and not status.startswith("4"))

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

    own_before = own_cpu_seconds()
    connector = aiohttp.TCPConnector(limit=clients, force_close=False)
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(client(session, i) for i in range(clients)))
    result.server_cpu_s = tree_cpu_seconds(server_pid) - cpu_before
    result.client_cpu_s = own_cpu_seconds() - own_before
    return result


def overload_new_connections(url: str, body: bytes, clients: int, seconds: float,
                             server_pid: int) -> Overload:
    """The same overload from ``clients`` threads, each attempt on a new connection; an
    answer after TIMEOUT_S counts as none ("late")."""
    result = Overload(clients, seconds)
    deadline = time.perf_counter() + seconds
    lock = threading.Lock()

    def client(index: int) -> None:
        headers = {"Content-Type": "image/jpeg", "X-Client-Id": f"app-{index}"}
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            status, missing = post_on_new_connection(url, body, headers, TIMEOUT_S)
            took = time.perf_counter() - started
            status = "late" if took > TIMEOUT_S else status
            with lock:
                result.statuses[status] += 1
                result.without_retry_after += missing
                if status == "200":
                    result.ok_latencies.append(took)
            if status != "200":
                time.sleep(RETRY_S)

    cpu_before, own_before = tree_cpu_seconds(server_pid), own_cpu_seconds()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + TIMEOUT_S + 5)
    result.server_cpu_s = tree_cpu_seconds(server_pid) - cpu_before
    result.client_cpu_s = own_cpu_seconds() - own_before
    return result


def run_overload(style: str, url: str, body: bytes, clients: int, seconds: float,
                 server_pid: int) -> Overload:
    if style == "kept-alive":
        return asyncio.run(overload(url, body, clients, seconds, server_pid))
    return overload_new_connections(url, body, clients, seconds, server_pid)


def _line(name: str, capacity: float, result: Overload) -> str:
    latencies = sorted(result.ok_latencies) or [float("nan")]
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    answers = sum(result.statuses.values()) or 1
    return (f"| {name} | {capacity:.1f} | {result.goodput:.1f} | "
            f"{result.goodput / capacity if capacity else float('nan'):.2f} | "
            f"{result.statuses['200']} | {sum(result.statuses[s] for s in REFUSALS)} | "
            f"{result.unanswered} | {result.without_retry_after} | {p99:.1f} | "
            f"{result.server_cpu_s / answers * 1000:.2f} | "
            f"{result.client_cpu_s / result.seconds:.2f} | {result.no_answer_kinds} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--naive", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--styles", nargs="+", choices=STYLES, default=list(STYLES))
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
    for style in args.styles:
        for name, command in servers.items():
            if name == "naive" and not args.naive:
                continue
            ratios = []
            for run in range(args.runs):
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                with running([*command, "--port", str(port)], f"{url}/readyz",
                             work / f"{name}-{style}-{run}.log", env) as process:
                    capacity = asyncio.run(run_load(f"{url}/v1/classify", body, 32,
                                                    args.seconds / 2, process.pid))
                    result = run_overload(style, f"{url}/v1/classify", body, args.clients,
                                          args.seconds, process.pid)
                rate = capacity.requests_per_second
                ratios.append(result.goodput / rate if rate else 0.0)
                rows.append(_line(f"{name}, {style}, run {run + 1}", rate, result))
                print(rows[-1], flush=True)
            print(f"{name}, {style}: median goodput / capacity "
                  f"{statistics.median(ratios):.2f}", flush=True)
    print(f"\ndate: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"{args.clients} clients, retry {RETRY_S} s after 429/503, timeout {TIMEOUT_S:.0f} s, "
          f"{args.seconds:.0f} s per overload; 2400x1600 JPEG ({len(body) // 1024} KiB)\n")
    print("| server | capacity c=32 img/s | goodput img/s | ratio | 200 | 429+503 | "
          "no answer | refusals without Retry-After | p99 of 200 s | server CPU ms "
          "per answer | clients' cores | instead of an answer |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
