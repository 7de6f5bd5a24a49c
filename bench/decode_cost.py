"""What decoding in worker processes costs, and what it stops, measured.

    python -m bench.decode_cost            # about 2 minutes; writes bench/results/

1. one decode worker's start: wall time until it is ready, its CPU time and memory;
2. per image (tests/data/coffee.jpg): decoding in this process vs. through a worker, in
   interleaved rounds; the difference is the cost of the processes (pickling, the pipe);
3. crafted files sent to a real server (``python -m app serve``): the answer and its wall
   time, the CPU time of the server's whole process tree (the replacement of a killed
   worker included), and a normal photo sent 0.5 s later; for contrast, the CPU a plain
   Pillow decode of the same scan bomb takes (what vramguard did before);
4. on Linux, one decode's peak memory in a fresh worker (VmHWM), against its prediction.

This module is what a spawned worker re-imports as its main module: heavy imports stay
inside the functions.
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
from PIL import Image

from app.imaging.decode_pool import DecodeLimits, DecodePool
from app.imaging.decoding import open_image
from app.imaging.pixels import model_input
from app.preprocessing import Preprocessing
from bench.process import ROOT, free_port, running, server_env

sys.path.insert(0, str(ROOT / "tests"))
import images  # the tests' generators of crafted files

SPEC = Preprocessing(resize=256, crop=224, mean=(127.0,) * 3, std=(128.0,) * 3)
MIB = 1024**2
LIMITS = DecodeLimits(max_pixels=40_000_000, max_image_bytes=300 * MIB, cpu_s=1.0,
                      max_body_bytes=32 * MIB)


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process, its live children, and its children that have ended."""
    process = psutil.Process(pid)
    times = process.cpu_times()
    total = times.user + times.system + times.children_user + times.children_system
    for child in process.children(recursive=True):
        try:
            child_times = child.cpu_times()
        except psutil.Error:
            continue
        total += child_times.user + child_times.system
    return float(total)


_START = """
if __name__ == "__main__":  # a worker re-runs this file: only the lines above this one
    import json, statistics, time
    import psutil
    from app.imaging.decode_pool import Worker
    from app.imaging.decode_worker import READY
    walls, cpus, rss, uss = [], [], [], []
    for _ in range(5):
        started = time.perf_counter()
        worker = Worker(memory_allowance=None)
        assert worker.receive(60) == (True, READY)
        walls.append(time.perf_counter() - started)
        cpus.append(worker.cpu_seconds())
        memory = psutil.Process(worker.process.pid).memory_full_info()
        rss.append(memory.rss)
        uss.append(memory.uss)
        worker.ask_to_stop()
        worker.end(kill=False)
    print(json.dumps([statistics.median(v) for v in (walls, cpus, rss, uss)]))
"""


def worker_start() -> list[str]:
    """Measured from a fresh interpreter, as the server starts them: from ``python -m app``
    a worker does not re-run the main module; from the ``vramguard`` script (and the
    bundle's executable) it does, which imports app.cli."""
    import json
    import subprocess

    lines = []
    folder = Path(tempfile.mkdtemp(prefix="vramguard-start-"))
    for how, prefix in (("python -m app", ""), ("vramguard script", "import app.cli.main\n")):
        script = folder / "start.py"
        script.write_text(prefix + _START)
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall, cpu, rss, uss = json.loads(done.stdout)
        lines.append(f"worker start from {how} (median of 5): {wall * 1000:.0f} ms wall, "
                     f"{cpu * 1000:.0f} ms CPU, RSS {rss / MIB:.0f} MiB, USS {uss / MIB:.0f} MiB")
    return lines


def per_image(count: int = 200, rounds: int = 3) -> list[str]:
    photo = images.photo()
    pool = DecodePool(1, LIMITS, 1024 * MIB)
    here, there = [], []
    try:
        pool.decode(photo, SPEC, time.monotonic() + 60)
        for _ in range(rounds):
            started = time.perf_counter()
            for _ in range(count):
                model_input(open_image(photo, LIMITS.max_pixels, SPEC.resize), SPEC)
            here.append((time.perf_counter() - started) / count)
            started = time.perf_counter()
            for _ in range(count):
                pool.decode(photo, SPEC, time.monotonic() + 60)
            there.append((time.perf_counter() - started) / count)
    finally:
        pool.close()
    in_process, in_worker = statistics.median(here) * 1000, statistics.median(there) * 1000
    return [f"per image, coffee.jpg (median of {rounds} rounds of {count}): in this process "
            f"{in_process:.2f} ms, through a worker {in_worker:.2f} ms, "
            f"difference {in_worker - in_process:+.2f} ms"]


def unguarded_pillow_cpu(data: bytes) -> float:
    """CPU seconds of the decode vramguard used to run on every upload."""
    started = time.process_time()
    image = Image.open(io.BytesIO(data))
    image.draft("RGB", (SPEC.resize, SPEC.resize))
    image.load()
    return time.process_time() - started


def noise_jpeg() -> bytes:
    """A 40-megapixel progressive JPEG of noise, just under 32 MiB: it passes the
    structural checks but takes more than a second of CPU to decode (the backstop case)."""
    rng = np.random.default_rng(0)
    pixels = np.clip(128 + rng.integers(-14, 14, (5000, 8000, 3)), 0, 255).astype(np.uint8)
    return images.encode(Image.fromarray(pixels), "JPEG", quality=95, progressive=True,
                         subsampling=0)


def through_a_server(crafted: dict[str, bytes]) -> list[str]:
    import httpx

    work = Path(tempfile.mkdtemp(prefix="vramguard-decode-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = server_env()
    env.update(VRAMGUARD_RATE_LIMIT="0", VRAMGUARD_CACHE_DIR=str(work / "cache"))
    serve = [sys.executable, "-m", "app", "serve", "--port", str(port), "--no-cache",
             "--log-level", "warning"]
    lines = []
    with running(serve, f"{url}/readyz", work / "server.log", env) as server, \
            httpx.Client(base_url=url, timeout=60) as client:
        headers = {"Content-Type": "image/jpeg"}

        def post(body: bytes, into: dict[str, object]) -> None:
            started = time.perf_counter()
            response = client.post("/v1/classify", content=body, headers=headers)
            into.update(status=response.status_code, seconds=time.perf_counter() - started,
                        code=response.json().get("error", {}).get("code", "ok"))

        for _ in range(5):
            post(images.photo(), {})
        before = tree_cpu(server.pid)
        post(images.photo(), {})
        photo_cpu = tree_cpu(server.pid) - before
        lines.append(f"a normal photo alone: {photo_cpu:.3f} s CPU (server tree)")
        for name, body in crafted.items():
            bad: dict[str, object] = {}
            good: dict[str, object] = {}
            time.sleep(1.0)
            before = tree_cpu(server.pid)
            sender = threading.Thread(target=post, args=(body, bad))
            sender.start()
            time.sleep(0.5)
            post(images.photo(), good)
            sender.join()
            time.sleep(1.5)  # a killed worker's replacement finishes starting
            spent = tree_cpu(server.pid) - before - photo_cpu
            lines.append(
                f"{name} ({len(body) / 1024:.0f} KiB): {bad['status']} {bad['code']} in "
                f"{bad['seconds']:.2f} s; server tree CPU for it {spent:.2f} s (the photo's "
                f"subtracted, replacement included); photo sent 0.5 s later: "
                f"{good['status']} in {good['seconds']:.2f} s")
    return lines


def _status_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def peak_memory(cases: dict[str, bytes]) -> list[str]:
    lines = ["| image | bytes | predicted MiB | measured MiB (worker VmHWM - start) |",
             "| --- | --- | --- | --- |"]
    for name, data in cases.items():
        pool = DecodePool(1, LIMITS, 1024 * MIB)
        try:
            pool.decode(images.photo(), SPEC, time.monotonic() + 60)
            (worker,) = pool._idle
            start = _status_mib(worker.process.pid, "VmRSS")
            predicted = open_image(data, LIMITS.max_pixels, SPEC.resize).peak_bytes / MIB
            try:
                pool.decode(data, SPEC, time.monotonic() + 60)
                outcome = ""
            except Exception as error:  # a refusal is a result here
                outcome = f" ({type(error).__name__})"
            measured = _status_mib(worker.process.pid, "VmHWM") - start
            lines.append(f"| {name}{outcome} | {len(data) / 1024:.0f} KiB | {predicted:.0f} | "
                         f"{measured:.0f} |")
        finally:
            pool.close()
    return lines


def main() -> int:
    bomb = images.scan_bomb()
    lines = [f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"machine: {psutil.cpu_count(logical=False)} physical cores, "
             f"{psutil.virtual_memory().total / 1024**3:.0f} GiB", ""]
    lines += worker_start()
    lines += per_image()
    lines.append(f"scan bomb, plain Pillow decode (before): {unguarded_pillow_cpu(bomb):.2f} s "
                 "CPU")
    for line in lines:
        print(line, flush=True)
    served = through_a_server({"scan bomb (40 MP, 2010 scans)": bomb,
                               "noise JPEG (passes the checks, > 1 s CPU)": noise_jpeg()})
    memory: list[str] = []
    if sys.platform.startswith("linux"):
        photo_like = images.encode(images.coffee_image().resize((4000, 3000)), "JPEG",
                                   quality=92)
        memory = peak_memory({
            **images.memory_bombs(),
            "RGB PNG 40 MP": images.flat_image("RGB", "PNG"),
            "progressive 4:4:4 JPEG 40 MP": images.encode(
                Image.new("RGB", (images.MEMORY_SIDE,) * 2, (9, 9, 9)), "JPEG",
                progressive=True, subsampling=0),
            "12 MP baseline JPEG": photo_like,
            "coffee.jpg": images.photo(),
        })
    lines += ["", *served, "", *memory]
    report = "\n".join(lines)
    print("\n" + report)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"decode-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.md").write_text(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
