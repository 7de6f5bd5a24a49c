"""How much one start of the same code differs from the next.

    python -m bench.start_spread [--starts 5] [--seconds 8] [--concurrency 8 32]

Five starts of vramguard and five of the naive server, alternating (vramguard, naive,
vramguard, ...), each measured at every concurrency after a short settle. The spread of a
server at a concurrency is max/min - 1 of its images/s over its starts: the old-vs-new
rule can resolve a change only larger than that. Beside each vramguard start, what its
warmup chose (batch size, measured images/s, whether a stored profile was reused), so a
start that chose differently is seen; its precision on a CPU is fp32 (``auto``), and the
forward pass's thread count is chosen batch by batch, not at warmup
(``app/engine/cpu_threads.py``). The first start measures the profile, later ones reuse
it, as a user's second start would. 127.0.0.1 only; every load is bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen import run_load
from bench.process import ROOT, free_port, running, server_env
from bench.run import machine

IMAGE = ROOT / "tests" / "data" / "coffee.jpg"
SETTLE_S = 3.0
USER_DIRS = ("HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME")


def _choices(url: str) -> dict[str, Any]:
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["models"][0]
    return {"batch": model.get("batch_size"), "warmup img/s": model.get("images_per_second"),
            "profile reused": model.get("profile_reused")}


def _one_start(name: str, command: list[str], levels: list[int], seconds: float,
               log: Path, env: dict[str, str]) -> tuple[dict[int, float], dict[str, Any]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    body = IMAGE.read_bytes()
    with running([*command, "--port", str(port)], f"{url}/readyz", log, env) as process:
        asyncio.run(run_load(f"{url}/v1/classify", body, 2, SETTLE_S, process.pid))
        rates = {}
        for level in levels:
            result = asyncio.run(run_load(f"{url}/v1/classify", body, level, seconds,
                                          process.pid))
            rates[level] = result.requests_per_second
        choices = _choices(url) if name == "vramguard" else {}
    return rates, choices


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vramguard-spread-"))
    # folders of its own: the first start measures the profile, the rest reuse that one
    home = {var: str(work / var.lower()) for var in USER_DIRS}
    env = server_env(VRAMGUARD_CACHE_DIR=str(work / "cache"), VRAMGUARD_RATE_LIMIT="0",
                     **home)
    servers = {"vramguard": [sys.executable, "-m", "app", "serve", "--no-cache",
                             "--log-level", "warning"],
               "naive": [sys.executable, "-m", "bench.naive_server"]}
    rates: dict[str, list[dict[int, float]]] = {name: [] for name in servers}
    rows = []
    print(f"machine: {machine()}", flush=True)
    for start in range(args.starts):
        for name, command in servers.items():
            measured, choices = _one_start(name, command, args.concurrency, args.seconds,
                                           work / f"{name}-{start}.log", env)
            rates[name].append(measured)
            cells = [name, str(start + 1),
                     *(f"{measured[level]:.1f}" for level in args.concurrency),
                     ", ".join(f"{key} {value}" for key, value in choices.items())]
            rows.append("| " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
    print(f"\ndate: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.starts} "
          f"starts each, alternating; {args.seconds:.0f} s per concurrency after a "
          f"{SETTLE_S:.0f} s settle; tests/data/coffee.jpg; result cache off\n")
    levels = " | ".join(f"img/s c={level}" for level in args.concurrency)
    print(f"| server | start | {levels} | warmup's choices |")
    print("| --- | --- | " + "--- | " * len(args.concurrency) + "--- |")
    print("\n".join(rows))
    print("\n| server | " + " | ".join(f"spread c={level}" for level in args.concurrency)
          + " |")
    print("| --- | " + "--- | " * len(args.concurrency))
    for name, runs in rates.items():
        spreads = []
        for level in args.concurrency:
            values = [run[level] for run in runs]
            spreads.append(f"{max(values) / min(values) - 1:.1%}" if min(values) else "n/a")
        print(f"| {name} | " + " | ".join(spreads) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
