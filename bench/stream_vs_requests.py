"""One image stream against one request per image: images per second, same server.

    python -m bench.stream_vs_requests [--images 500] [--concurrency 8] [--rounds 4]

Each round sends the same ``--images`` photos (``tests/data``'s two, alternating) twice,
in an order that alternates between rounds: once as one ``POST /v1/classify/stream``
(read while it is sent, as ``vramguard classify`` does), once as separate ``POST
/v1/classify`` requests, ``--concurrency`` at a time on keep-alive connections, each
refusal (503, 429) sent again after its Retry-After as the client package does (the
stream waits for room instead). Reported per round: images per second and the stream's
share over the requests; CPU milliseconds per image of the server's event loop (its main
thread: what the route itself costs, HTTP and gates included, and the figure least moved
by other load on the machine), of the whole server (its process tree: mostly the forward
pass, whose cost on an oversubscribed CPU swings with contention), and of this client;
mean batch size. One server, result cache off, batch size 4 pinned, rate limit off (it
would cap both at the same 50 images/s per client). 127.0.0.1 only; not part of CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import psutil

from bench.process import ROOT, free_port, running, server_env, tree_cpu_seconds
from bench.run import machine

BOUNDARY = "vramguard-bench-stream"
RETRIES = 20
WARMUP_IMAGES = 80  # per mode, twice: admission's rate estimate is measured in service


def photos(count: int) -> list[bytes]:
    data = [(ROOT / "tests" / "data" / name).read_bytes()
            for name in ("coffee.jpg", "chelsea.jpg")]
    return [data[i % len(data)] for i in range(count)]


async def as_stream(url: str, images: list[bytes]) -> tuple[int, int]:
    """One stream; the number of images answered with a result (and of refusals: none,
    the stream waits for room)."""

    async def body() -> AsyncIterator[bytes]:
        for i, image in enumerate(images):
            yield (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
                   f"filename=\"{i}.jpg\"\r\n\r\n").encode() + image + b"\r\n"
        yield f"--{BOUNDARY}--\r\n".encode()

    ok = 0
    headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session,
                session.post(f"{url}/v1/classify/stream", data=body(),
                             headers=headers) as response):
        response.raise_for_status()
        async for line in response.content:
            ok += '"result"' in line.decode()
    return ok, 0


async def as_requests(url: str, images: list[bytes], concurrency: int) -> tuple[int, int]:
    """One request per image, ``concurrency`` at a time, each refusal sent again after
    its Retry-After (at most ``RETRIES`` times); the number answered 200, of refusals."""
    pending = iter(images)
    ok = refused = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal ok, refused
        for image in pending:
            for _ in range(RETRIES):
                async with session.post(f"{url}/v1/classify", data=image,
                                        headers={"Content-Type": "image/jpeg"}) as response:
                    await response.read()
                    wait = float(response.headers.get("Retry-After", 0))
                if response.status not in (429, 503):
                    break
                refused += 1
                await asyncio.sleep(wait)
            ok += response.status == 200

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=900)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return ok, refused


def batches(url: str) -> tuple[int, int]:
    stats = json.loads(urllib.request.urlopen(f"{url}/v1/stats", timeout=30).read())
    return stats["batches"], stats["batched_images"]


def event_loop_cpu(pid: int) -> float:
    """CPU seconds of the server's main thread, where uvicorn runs the event loop."""
    found = [t for t in psutil.Process(pid).threads() if t.id == pid]
    return found[0].user_time + found[0].system_time


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(mode: str, url: str, pid: int, images: list[bytes],
            concurrency: int) -> dict[str, float]:
    cpu, loop, client = tree_cpu_seconds(pid), event_loop_cpu(pid), own_cpu()
    runs, batched = batches(url)
    started = time.perf_counter()
    work = (as_stream(url, images) if mode == "stream"
            else as_requests(url, images, concurrency))
    ok, refused = asyncio.run(work)
    seconds = time.perf_counter() - started
    if ok != len(images):
        raise RuntimeError(f"{mode}: {ok} of {len(images)} images answered")
    runs_after, batched_after = batches(url)
    return {"images_per_s": len(images) / seconds, "seconds": seconds,
            "event_loop_cpu_ms_per_image": (event_loop_cpu(pid) - loop) * 1000 / len(images),
            "server_cpu_ms_per_image": (tree_cpu_seconds(pid) - cpu) * 1000 / len(images),
            "client_cpu_ms_per_image": (own_cpu() - client) * 1000 / len(images),
            "refusals": refused,
            "mean_batch": (batched_after - batched) / max(1, runs_after - runs),
            "load_average": os.getloadavg()[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vramguard-stream-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = server_env(VRAMGUARD_RATE_LIMIT="0", VRAMGUARD_TOKEN_FILE=str(work / "token"),
                     VRAMGUARD_LOG_DIR=str(work / "logs"),
                     VRAMGUARD_PROFILE_DIR=str(work / "profiles"))
    images = photos(args.images)
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f}", flush=True)
    rows: list[dict[str, object]] = []
    command = [sys.executable, "-m", "app", "serve", "--port", str(port), "--no-cache",
               "--batch-size", "4"]
    with running(command, f"{url}/readyz", work / "server.log", env=env) as process:
        for mode in ("stream", "requests") * 2:  # decoders, allocator, measured rates
            measure(mode, url, process.pid, images[:WARMUP_IMAGES], args.concurrency)
        for round_ in range(args.rounds):
            order = ("stream", "requests") if round_ % 2 == 0 else ("requests", "stream")
            results = {mode: measure(mode, url, process.pid, images, args.concurrency)
                       for mode in order}
            ratio = results["stream"]["images_per_s"] / results["requests"]["images_per_s"]
            rows.append({"round": round_ + 1, "first": order[0], **{
                f"{mode}_{key}": value for mode, found in results.items()
                for key, value in found.items()}, "ratio": ratio})
            print(f"round {round_ + 1} ({order[0]} first): images/s stream "
                  f"{results['stream']['images_per_s']:.1f}, requests "
                  f"{results['requests']['images_per_s']:.1f}, ratio {ratio:.2f}; CPU "
                  "ms/image (stream vs requests): " + ", ".join(
                      f"{what} {results['stream'][key]:.2f} vs {results['requests'][key]:.2f}"
                      for what, key in (("event loop", "event_loop_cpu_ms_per_image"),
                                        ("server", "server_cpu_ms_per_image"),
                                        ("client", "client_cpu_ms_per_image"),
                                        ("mean batch", "mean_batch"))) +
                  f"; requests refused and sent again {results['requests']['refusals']}; "
                  f"load {results['stream']['load_average']:.1f}", flush=True)
    ratios = [float(str(row["ratio"])) for row in rows]
    loops = [float(str(row["stream_event_loop_cpu_ms_per_image"])) /
             float(str(row["requests_event_loop_cpu_ms_per_image"])) for row in rows]
    print(f"median ratio (stream / requests): images/s {statistics.median(ratios):.2f} "
          f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)}); event-loop CPU per image "
          f"{statistics.median(loops):.2f} (rounds: {', '.join(f'{r:.2f}' for r in loops)})")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (args.out / f"stream-vs-requests-{stamp}.json").write_text(json.dumps(
        {"machine": machine(), "images": args.images, "concurrency": args.concurrency,
         "rounds": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
