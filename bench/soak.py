"""Soak: a long mixed load, watching the server's memory and open files drift.

    python -m bench.soak [--minutes 30] [--concurrency 8] [--settle-minutes 5]

Concurrency 8 against one server, cycling through normal photos, odd but valid
images (16-bit, CMYK, palette, animated GIF) and every bad-input kind from the
tests. Every 10 s it samples the PSS of the server's process tree and its open
file descriptors. Pass: PSS drift after the settling minutes under 2 %, no 5xx
but the designed 503s, no growth in file descriptors. 127.0.0.1 only; stops by
itself.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

from bench.loadgen import tree_pss
from bench.process import ROOT, free_port, process_tree, running, server_env
from bench.run import machine

sys.path.insert(0, str(ROOT / "tests"))
from images import bad_images, odd_valid_images, photo

SAMPLE_S = 10.0
DESIGNED_503 = {"overloaded", "deadline_exceeded", "insufficient_memory"}


def inputs() -> list[tuple[str, bytes]]:
    """What the clients send, in turn: mostly photos, with every odd and bad kind."""
    photos = [("photo", photo()), ("photo-2", photo("chelsea.jpg"))] * 4
    return [*photos, *odd_valid_images().items(), *bad_images().items()]


def open_files(pid: int) -> int:
    return sum(member.num_fds() for member in process_tree(pid))


async def soak(url: str, pid: int, seconds: float, concurrency: int, settle_s: float) -> int:
    statuses: Counter[str] = Counter()
    unexpected: Counter[str] = Counter()
    samples: list[tuple[float, int, int]] = []
    deadline = time.monotonic() + seconds
    started = time.monotonic()
    bodies = inputs()

    async def client(session: aiohttp.ClientSession, offset: int) -> None:
        for name, body in itertools.islice(itertools.cycle(bodies), offset, None):
            if time.monotonic() >= deadline:
                return
            async with session.post(url, data=body,
                                    headers={"Content-Type": "image/jpeg"}) as response:
                payload = await response.json(content_type=None)
                statuses[str(response.status)] += 1
                if response.status >= 500:
                    code = payload.get("error", {}).get("code") if isinstance(payload, dict) \
                        else None
                    if response.status != 503 or code not in DESIGNED_503:
                        unexpected[f"{response.status} {code} ({name})"] += 1

    async def watch() -> None:
        while time.monotonic() < deadline:
            samples.append((time.monotonic() - started, tree_pss(pid), open_files(pid)))
            print(f"  {samples[-1][0]:6.0f} s  PSS {samples[-1][1] / 1024**2:7.1f} MiB  "
                  f"fds {samples[-1][2]}  {dict(statuses)}", flush=True)
            await asyncio.sleep(SAMPLE_S)

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(watch(), *(client(session, i) for i in range(concurrency)))
    settled = [s for s in samples if s[0] >= settle_s] or samples
    base_pss, last_pss = settled[0][1], settled[-1][1]
    drift = (last_pss - base_pss) / base_pss
    fds_growth = settled[-1][2] - settled[0][2]
    print(f"\ndate: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"machine: {machine()}")
    print(f"{seconds / 60:.0f} min at concurrency {concurrency}; answers {dict(statuses)}")
    print(f"PSS after {settle_s / 60:.0f} min {base_pss / 1024**2:.1f} MiB, at the end "
          f"{last_pss / 1024**2:.1f} MiB: drift {drift:+.2%} (limit 2 %); max "
          f"{max(s[1] for s in settled) / 1024**2:.1f} MiB")
    print(f"open files {settled[0][2]} -> {settled[-1][2]}; unexpected 5xx: "
          f"{dict(unexpected) or 'none'}")
    ok = abs(drift) < 0.02 and fds_growth <= 0 and not unexpected
    print("SOAK PASSED" if ok else "SOAK FAILED")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--settle-minutes", type=float, default=5.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vramguard-soak-"))
    env = server_env()
    env |= {"VRAMGUARD_CACHE_DIR": str(work / "cache"), "VRAMGUARD_RATE_LIMIT": "0"}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "app", "serve", "--no-cache", "--port", str(port),
               "--log-level", "warning"]
    with running(command, f"{url}/readyz", work / "soak.log", env) as process:
        return asyncio.run(soak(f"{url}/v1/classify", process.pid, args.minutes * 60,
                                args.concurrency, args.settle_minutes * 60))


if __name__ == "__main__":
    raise SystemExit(main())
