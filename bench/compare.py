"""Old commit vs. this tree vs. the naive server, interleaved in one run.

    python -m bench.compare BASE_REF [--concurrency 1 8 32] [--seconds 24] [--rounds 4]

"No slower" means: the new tree's throughput ratio to the naive server keeps at
least 0.95 of the old commit's ratio, both measured in the same run. The old
commit is checked out into a temporary git worktree and served from there with
this venv (``python -m app`` imports the package from its working folder); the
three servers then take turns under the same closed-loop load, round by round,
so a machine that drifts slows all of them alike.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from bench.loadgen import LoadResult, run_load
from bench.process import ROOT, free_port, running, server_env
from bench.run import IMAGE, machine

KEEP = 0.95  # the new tree must keep this share of the old commit's ratio to naive


def _worktree(ref: str, folder: Path) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), ref],
                   check=True, capture_output=True)


def _serve(stack: ExitStack, name: str, cwd: Path, work: Path, env: dict[str, str],
           batch_size: int | None, naive: bool = False) -> tuple[str, int]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = ([sys.executable, "-m", "bench.naive_server", "--port", str(port)] if naive else
               [sys.executable, "-m", "app", "serve", "--log-level", "warning", "--no-cache",
                "--port", str(port),
                *(["--batch-size", str(batch_size)] if batch_size else [])])
    process = stack.enter_context(running(command, f"{url}/readyz", work / f"{name}.log",
                                          {**env, "VRAMGUARD_CACHE_DIR": str(work / name),
                                           # each measures its own profile, as at a
                                           # first start: none reuses another's
                                           "VRAMGUARD_PROFILE_DIR": str(work / f"{name}-p")},
                                          cwd=cwd))
    return f"{url}/v1/classify", process.pid


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", help="the old commit (e.g. a hash or HEAD~1)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=24.0,
                        help="per server and level, split over the rounds")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4,
                        help="pinned for both commits (0: warmup's choice): three servers "
                        "warming up side by side pick from noisy timings, and the pick "
                        "moves throughput more than most changes do")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vramguard-compare-"))
    base_tree = work / "base"
    _worktree(args.base, base_tree)
    env = server_env()
    env["VRAMGUARD_RATE_LIMIT"] = "0"
    body = IMAGE.read_bytes()
    print(f"machine: {machine()}", flush=True)
    try:
        with ExitStack() as stack:
            servers = {"old": _serve(stack, "old", base_tree, work, env, args.batch_size),
                       "new": _serve(stack, "new", ROOT, work, env, args.batch_size),
                       "naive": _serve(stack, "naive", ROOT, work, env, None, naive=True)}
            for url, pid in servers.values():  # one-off costs: allocator growth, lazy imports
                asyncio.run(run_load(url, body, 2, 2.0, pid))
            pooled: dict[tuple[int, str], LoadResult] = {}
            for level in args.concurrency:
                for round_ in range(args.rounds):
                    order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
                    for name in order:
                        url, pid = servers[name]
                        result = asyncio.run(run_load(url, body, level,
                                                      args.seconds / args.rounds, pid))
                        key = (level, name)
                        pooled[key] = pooled[key].merge(result) if key in pooled else result
                        print(f"  c={level:<3} round {round_ + 1} {name:<6} "
                              f"{result.requests_per_second:6.1f} req/s, errors "
                              f"{result.errors}", flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                        str(base_tree)], check=False, capture_output=True)
    lines = [f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"machine: {machine()}",
             f"base: {args.base}; {args.seconds:.0f} s per server and level in {args.rounds} "
             "interleaved rounds (order alternating); cache off; batch size "
             f"{args.batch_size or 'chosen by warmup'}",
             "", "| c | server | req/s | p50 ms | p99 ms | errors | peak PSS MiB |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for (level, name), r in pooled.items():
        lines.append(f"| {level} | {name} | {r.requests_per_second:.1f} | "
                     f"{r.percentile(50) * 1000:.0f} | {r.percentile(99) * 1000:.0f} | "
                     f"{r.errors} | {r.peak_pss_bytes / 1024**2:.0f} |")
    lines += ["", "| c | old / naive | new / naive | new keeps of old's ratio |",
              "| --- | --- | --- | --- |"]
    kept = True
    for level in args.concurrency:
        naive = pooled[(level, "naive")].requests_per_second
        old, new = (pooled[(level, n)].requests_per_second / naive for n in ("old", "new"))
        kept = kept and new >= KEEP * old
        lines.append(f"| {level} | {old:.3f} | {new:.3f} | {new / old:.3f} |")
    lines += ["", f"new keeps {KEEP} of old's ratio at every level: {'yes' if kept else 'NO'}"]
    print("\n" + "\n".join(lines))
    return 0 if kept else 1


if __name__ == "__main__":
    raise SystemExit(main())
