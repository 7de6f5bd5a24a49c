"""What a refusal costs: server and client CPU per 429 and per 503, old commit vs. this tree.

    python -m bench.refusal_cost BASE_REF [--seconds 8] [--clients 32]
                                 [--styles kept-alive new-connection]

Under overload most answers are refusals, so their cost decides how much CPU is left for
the images that are served. Each server gets, in turn, ``--clients`` keep-alive clients
that send a photo as fast as they are answered, configured so that every answer is
the refusal being measured:

- **429**: one client id and a bucket of one request (``classify_burst=1``);
- **503**: a deadline no image can meet (``request_timeout_s=0.001``), the refusal a
  full queue gives.

Both with the 2400x1600 photo of ``bench.goodput`` (463 KiB) and with a 1 KiB body, and
in both client styles of ``bench.goodput`` (kept-alive aiohttp connections, and a thread
per client with a new connection per attempt).
CPU is the server's whole process tree and this process (the clients), per answer.
127.0.0.1 only; every load is bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import aiohttp

from bench.compare import _worktree
from bench.goodput import STYLES, large_photo, post_on_new_connection
from bench.process import (
    ROOT,
    free_port,
    own_cpu_seconds,
    running,
    server_env,
    tree_cpu_seconds,
)
from bench.run import machine

KINDS = {"429": {"VRAMGUARD_CLASSIFY_BURST": "1", "VRAMGUARD_CLASSIFY_PER_S": "0.001"},
         "503": {"VRAMGUARD_REQUEST_TIMEOUT_S": "0.001", "VRAMGUARD_RATE_LIMIT": "0"}}


async def _flood(url: str, body: bytes, clients: int, seconds: float) -> dict[str, int]:
    statuses: dict[str, int] = {}
    end = time.perf_counter() + seconds
    headers = {"Content-Type": "image/jpeg", "X-Client-Id": "one"}

    async def client(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < end:
            try:
                async with session.post(url, data=body, headers=headers) as response:
                    await response.read()
                    status = str(response.status)
            except aiohttp.ClientError as exc:
                status = type(exc).__name__
            statuses[status] = statuses.get(status, 0) + 1

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=30)) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return statuses


def _flood_new_connections(url: str, body: bytes, clients: int,
                           seconds: float) -> dict[str, int]:
    statuses: dict[str, int] = {}
    end = time.perf_counter() + seconds
    headers = {"Content-Type": "image/jpeg", "X-Client-Id": "one"}
    lock = threading.Lock()

    def client() -> None:
        while time.perf_counter() < end:
            status, _ = post_on_new_connection(url, body, headers, 30)
            with lock:
                statuses[status] = statuses.get(status, 0) + 1

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 35)
    return statuses


def _flood_in(style: str, url: str, body: bytes, clients: int,
              seconds: float) -> dict[str, int]:
    if style == "kept-alive":
        return asyncio.run(_flood(url, body, clients, seconds))
    return _flood_new_connections(url, body, clients, seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", help="the old commit (e.g. a hash or HEAD~1)")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--styles", nargs="+", choices=STYLES, default=list(STYLES))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vramguard-refusals-"))
    _worktree(args.base, work / "base")
    bodies = {"463 KiB": large_photo(), "1 KiB": bytes(1024)}
    rows = []
    print(f"machine: {machine()}", flush=True)
    try:
        for kind, settings in KINDS.items():
            with ExitStack() as stack:
                servers = {}
                for name, tree in (("old", work / "base"), ("new", ROOT)):
                    port = free_port()
                    env = server_env(VRAMGUARD_CACHE_DIR=str(work / f"{name}-cache"), **settings)
                    command = [sys.executable, "-m", "app", "serve", "--no-cache",
                               "--log-level", "error", "--port", str(port)]
                    process = stack.enter_context(running(
                        command, f"http://127.0.0.1:{port}/readyz",
                        work / f"{name}-{kind}.log", env, cwd=tree))
                    servers[name] = (f"http://127.0.0.1:{port}/v1/classify", process.pid)
                for size, body in bodies.items():
                    for style in args.styles:
                        for name, (url, pid) in servers.items():
                            server_before, own_before = tree_cpu_seconds(pid), own_cpu_seconds()
                            statuses = _flood_in(style, url, body, args.clients, args.seconds)
                            answers = sum(statuses.values()) or 1
                            server_ms = (tree_cpu_seconds(pid) - server_before) / answers * 1000
                            client_ms = (own_cpu_seconds() - own_before) / answers * 1000
                            rows.append(
                                f"| {kind} | {size} | {style} | {name} | "
                                f"{answers / args.seconds:.0f} | {server_ms:.2f} | "
                                f"{client_ms:.2f} | "
                                f"{', '.join(f'{n} x {s}' for s, n in statuses.items())} |")
                            print(rows[-1], flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                        str(work / "base")], check=False, capture_output=True)
    print(f"\ndate: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"base: {args.base}; {args.clients} clients, {args.seconds:.0f} s per server, "
          "kind and body\n")
    print("| refusal | body | clients | server | answers/s | server CPU ms per answer | "
          "client CPU ms per answer | statuses |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
