"""One command, one run: vramguard vs. the naive server vs. the offline limit.

    python -m bench.run [--seconds 16] [--rounds 2] [--concurrency 1 8 32 64]

The speed of a shared machine drifts from minute to minute, so the servers are
measured in interleaved rounds (vramguard, naive, vramguard, naive, ...) at
each concurrency, with the result cache off, and the offline limit is measured
before and after (the higher counts). Cache-hit throughput is measured
separately. Each row says how many cores the server's process tree kept busy and the
load generator's own share. The idle return: vramguard's PSS after warmup and the first
requests, against its PSS after every load, once its quiet-spell upkeep has given memory
back (``idle_release_s``, 60 s by default; target: within 5 %). Prints a table with the
ratios and writes it to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import torch

from app.models import DEFAULT_MODEL, load_model
from bench.loadgen import LoadResult, run_load, tree_pss
from bench.offline import offline_limit
from bench.process import ROOT, free_port, running, server_env

IMAGE = ROOT / "tests" / "data" / "coffee.jpg"
IDLE_RETURN_LIMIT_S = 90.0  # the longest wait for the quiet-spell upkeep (60 s by default)


@dataclass
class Row:
    server: str
    result: LoadResult

    def cells(self) -> list[str]:
        r = self.result
        return [self.server, str(r.concurrency), f"{r.requests_per_second:.1f}",
                f"{r.percentile(50) * 1000:.0f}", f"{r.percentile(90) * 1000:.0f}",
                f"{r.percentile(99) * 1000:.0f}", str(r.ok), str(r.errors),
                f"{r.peak_pss_bytes / 1024**2:.0f}", f"{r.server_cores:.2f}",
                f"{r.client_cores:.2f}"]


def _settle(url: str, pid: int) -> None:
    """First requests pay one-off costs (allocator growth, lazy imports)."""
    asyncio.run(run_load(url, IMAGE.read_bytes(), 2, 2.0, pid))


def _interleaved(servers: dict[str, tuple[str, int]], levels: list[int], seconds: float,
                 rounds: int) -> list[Row]:
    body = IMAGE.read_bytes()
    rows = []
    for concurrency in levels:
        pooled: dict[str, LoadResult] = {}
        for _ in range(rounds):
            for name, (url, pid) in servers.items():
                result = asyncio.run(run_load(url, body, concurrency, seconds / rounds, pid))
                pooled[name] = pooled[name].merge(result) if name in pooled else result
        for name, result in pooled.items():
            rows.append(Row(name, result))
            print(f"  {name:<10} c={concurrency:<3} {result.requests_per_second:6.1f} req/s  "
                  f"p99 {result.percentile(99) * 1000:6.0f} ms  errors {result.errors}",
                  flush=True)
    return rows


def _idle_release_latency(url: str) -> tuple[float, float]:
    """Median warm latency, and the latency of the first request after an idle release."""
    body = IMAGE.read_bytes()
    with httpx.Client(base_url=url, timeout=60) as client:
        def timed() -> float:
            started = time.perf_counter()
            client.post("/v1/classify", content=body, headers={"Content-Type": "image/jpeg"})
            return (time.perf_counter() - started) * 1000

        warm = sorted(timed() for _ in range(15))[7]
        deadline = time.monotonic() + 10
        while client.get("/v1/memory").json()["idle_releases"] < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the server never released its memory while idle")
            time.sleep(0.2)
        return warm, timed()


def _idle_return(url: str, pid: int, releases_before: int) -> tuple[int, float]:
    """PSS once the server has given memory back after the loads, and the wait for it."""
    started = time.monotonic()
    with httpx.Client(base_url=url, timeout=10) as client:
        while (client.get("/v1/memory").json()["idle_releases"] <= releases_before
               and time.monotonic() - started < IDLE_RETURN_LIMIT_S):
            time.sleep(1)
    time.sleep(1)  # the release itself
    return tree_pss(pid), time.monotonic() - started


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return (f"{platform.system()} {platform.machine()} ({cpu}), "
            f"{psutil.cpu_count(logical=False)} physical / {psutil.cpu_count()} logical cores, "
            f"{psutil.virtual_memory().total / 1024**3:.0f} GiB, torch {torch.__version__}, "
            f"{'CUDA ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=16.0,
                        help="per server and load level, split over the rounds")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vramguard-bench-"))
    env = server_env()
    env["VRAMGUARD_CACHE_DIR"] = str(work / "cache")
    env["VRAMGUARD_RATE_LIMIT"] = "0"  # capacity is measured here, not the per-client limit

    print(f"machine: {machine()}", flush=True)
    model = load_model(DEFAULT_MODEL, torch.device("cpu"))
    offline_seconds = min(args.seconds / 3, 5)
    best, offline_all = offline_limit(model, IMAGE.read_bytes(), seconds=offline_seconds)

    ours_port, naive_port = free_port(), free_port()
    ours, naive = f"http://127.0.0.1:{ours_port}", f"http://127.0.0.1:{naive_port}"
    serve = [sys.executable, "-m", "app", "serve", "--log-level", "warning"]
    with running([*serve, "--port", str(ours_port), "--no-cache"], f"{ours}/readyz",
                 work / "vramguard.log", env) as ours_proc, \
            running([sys.executable, "-m", "bench.naive_server", "--port", str(naive_port)],
                    f"{naive}/readyz", work / "naive.log", env) as naive_proc:
        chosen = httpx.get(f"{ours}/v1/models").json()["models"][0]["max_batch_size"]
        servers = {"vramguard": (f"{ours}/v1/classify", ours_proc.pid),
                   "naive": (f"{naive}/v1/classify", naive_proc.pid)}
        for url, pid in servers.values():
            _settle(url, pid)
        settled_pss = tree_pss(ours_proc.pid)
        releases = httpx.get(f"{ours}/v1/memory").json()["idle_releases"]
        rows = _interleaved(servers, args.concurrency, args.seconds, args.rounds)
        idle_pss, idle_wait_s = _idle_return(ours, ours_proc.pid, releases)
    with running([*serve, "--port", str(ours_port)], f"{ours}/readyz", work / "cached.log",
                 env) as proc:
        hits = asyncio.run(run_load(f"{ours}/v1/classify", IMAGE.read_bytes(), 8,
                                    min(args.seconds, 5), proc.pid))
    with running([*serve, "--port", str(ours_port), "--no-cache", "--idle-release-s", "1"],
                 f"{ours}/readyz", work / "idle.log", env):
        warm_ms, after_release_ms = _idle_release_latency(ours)
    best_after, offline_after = offline_limit(model, IMAGE.read_bytes(), seconds=offline_seconds)
    if best_after.images_per_second > best.images_per_second:
        best, offline_all = best_after, offline_after
    for r in offline_all:
        print(f"  offline batch {r.batch_size}: {r.images_per_second:.1f} img/s", flush=True)

    by = {(row.server, row.result.concurrency): row.result for row in rows}
    lines = [
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"machine: {machine()}",
        f"model: {DEFAULT_MODEL}; image: tests/data/coffee.jpg (600x400 JPEG); "
        f"{args.seconds:.0f} s per server and level in {args.rounds} interleaved rounds; "
        "result cache off",
        f"offline limit (best of before/after): {best.images_per_second:.1f} img/s "
        f"at batch {best.batch_size} ("
        + ", ".join(f"b{r.batch_size} {r.images_per_second:.1f}" for r in offline_all) + ")",
        f"vramguard warmup chose batch size {chosen}",
        "",
        "| server | concurrency | req/s | p50 ms | p90 ms | p99 ms | ok | errors | peak PSS MiB "
        "| server cores | load generator cores |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *("| " + " | ".join(row.cells()) + " |" for row in rows),
        "",
        "| concurrency | vramguard / naive | vramguard / offline limit | p99 vramguard / naive "
        "| peak PSS vramguard / naive |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in args.concurrency:
        ours, theirs = by[("vramguard", c)], by[("naive", c)]
        lines.append(
            f"| {c} | {ours.requests_per_second / theirs.requests_per_second:.2f} | "
            f"{ours.requests_per_second / best.images_per_second:.2f} | "
            f"{ours.percentile(99) / theirs.percentile(99):.2f} | "
            f"{ours.peak_pss_bytes / theirs.peak_pss_bytes:.2f} |")
    lines += ["", f"cache hits (same image, concurrency 8): {hits.requests_per_second:.0f} req/s, "
              f"p99 {hits.percentile(99) * 1000:.1f} ms, errors {hits.errors}",
              f"first request after an idle release: {after_release_ms:.0f} ms "
              f"(warm median {warm_ms:.0f} ms)",
              f"idle return: PSS {settled_pss / 1024**2:.0f} MiB after warmup, "
              f"{idle_pss / 1024**2:.0f} MiB {idle_wait_s:.0f} s after the last load, once "
              f"idle ({idle_pss / settled_pss - 1:+.1%})"]
    report = "\n".join(lines)
    print("\n" + report)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    (args.out / f"bench-{stamp}.md").write_text(report + "\n")
    (args.out / f"bench-{stamp}.json").write_text(json.dumps(
        {"offline": [vars(r) for r in offline_all],
         "rows": [{"server": r.server, "concurrency": r.result.concurrency,
                   "rps": r.result.requests_per_second, "p50": r.result.percentile(50),
                   "p99": r.result.percentile(99), "statuses": dict(r.result.statuses),
                   "peak_pss": r.result.peak_pss_bytes} for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
