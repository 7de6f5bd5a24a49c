"""Where the memory goes: vramguard vs. the naive server, whole process trees, by PSS.

    python -m bench.memory_budget [--seconds 20] [--concurrency 32] [--idle-release-s 5]
        [--env NAME=VALUE ...] [--tree PATH] [--servers naive vramguard] [--profile-dir P]

Each server runs alone (never side by side: the pages of torch's libraries they share
would be split between them and make both look smaller), on 127.0.0.1, and goes through:
ready (post-warmup figure) -> closed-loop load with real photos at ``--concurrency`` for
``--seconds``, the whole tree's PSS sampled every 0.2 s -> quiet until vramguard's idle
release has run (``VRAMGUARD_IDLE_RELEASE_S``; the naive server just waits as long) ->
the figure after idle. PSS counts a page shared by n processes as 1/n in each, so the sum
over a tree (server + decode workers) is what the tree costs the machine; pages shared
with processes outside the tree (other users of the same torch) still lower it, so USS
(private pages) and anonymous memory are reported too, and are the steadier numbers.

``--env`` changes only vramguard's environment (an allocator setting), so a candidate is
measured against the same naive baseline; ``--tree`` serves both from another source tree
(a scratch worktree with a proposed change; the naive server shares its model code).
Linux only (``/proc``). Stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from bench.loadgen import LoadResult, run_load
from bench.process import ROOT, free_port, process_tree, running, server_env

IMAGES = (ROOT / "tests" / "data" / "coffee.jpg", ROOT / "tests" / "data" / "chelsea.jpg")
SAMPLE_EVERY_S = 0.2
MIB = 1024**2
ARENA_BYTES = 64 * MIB  # glibc's HEAP_MAX_SIZE on 64-bit: each thread arena reserves this


@dataclass(frozen=True)
class Usage:
    """One process's memory, in bytes, from /proc/<pid>/smaps_rollup."""

    rss: int = 0
    pss: int = 0
    uss: int = 0
    pss_anon: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.rss + other.rss, self.pss + other.pss, self.uss + other.uss,
                     self.pss_anon + other.pss_anon)


def usage(pid: int) -> Usage:
    """smaps_rollup in one read: cheap enough to sample a whole tree every 0.2 s, unlike a
    full smaps walk (psutil's memory_full_info)."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return Usage(rss=fields["Rss"], pss=fields["Pss"],
                 uss=fields["Private_Clean"] + fields["Private_Dirty"],
                 pss_anon=fields["Pss_Anon"])


@dataclass(frozen=True)
class TreeUsage:
    """A server and its children at one moment."""

    main: Usage
    children: list[Usage]

    @property
    def total(self) -> Usage:
        return sum(self.children, self.main)


def tree_usage(pid: int) -> TreeUsage:
    children = []
    for child in process_tree(pid)[1:]:
        try:
            children.append(usage(child.pid))
        except (FileNotFoundError, ProcessLookupError):  # a worker replaced just now
            continue
    return TreeUsage(usage(pid), children)


def _mapped_files(pid: int) -> dict[str, int]:
    """Resident bytes of each file the process maps."""
    files: dict[str, int] = {}
    name = ""
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if head[0] == "Rss:":
                if name.startswith("/"):
                    files[name] = files.get(name, 0) + int(head[1]) * 1024
            elif not head[0].endswith(":"):
                name = head[5] if len(head) > 5 else ""
    return files


def files_alone(pid: int) -> int:
    """Resident file pages of the tree as if nothing else mapped them: each file once, at
    the most any member holds of it. PSS splits these pages with every process that maps
    them, other programs' torch included, so it moves with whatever else runs; this plus
    the anonymous PSS is what the tree would cost on a machine of its own."""
    union: dict[str, int] = {}
    for member in process_tree(pid):
        with suppress(FileNotFoundError, ProcessLookupError):
            for path, size in _mapped_files(member.pid).items():
                union[path] = max(union.get(path, 0), size)
    return sum(union.values())


@dataclass(frozen=True)
class Anatomy:
    """The main process's resident memory by kind of mapping (from /proc/<pid>/smaps)."""

    heap: int  # the main arena ([heap], brk)
    arenas: int  # glibc thread arenas: anonymous, 64 MiB-aligned, 64 MiB reserved
    arena_count: int
    other_anon: int  # large allocations mmapped on their own, thread stacks
    files: int  # libraries and other mapped files
    threads: int


def anatomy(pid: int) -> Anatomy:
    """Classify each mapping's RSS. A thread arena is recognised by glibc's layout: an
    anonymous mapping at a 64 MiB boundary whose usable part and the reserved
    (PROT_NONE) rest after it add up to 64 MiB."""
    regions: list[tuple[int, int, str, str, int]] = []  # start, end, perms, name, rss
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                start, end = (int(x, 16) for x in head[0].split("-"))
                regions.append((start, end, head[1], head[5] if len(head) > 5 else "", 0))
            elif head[0] == "Rss:":
                start, end, perms, name, _ = regions[-1]
                regions[-1] = (start, end, perms, name, int(head[1]) * 1024)
    heap = arenas = other = files = count = 0
    for i, (start, end, perms, name, rss) in enumerate(regions):
        following = regions[i + 1] if i + 1 < len(regions) else None
        reserved = (following[1] - following[0] if following and following[0] == end
                    and following[2].startswith("---") and not following[3] else 0)
        if name == "[heap]":
            heap += rss
        elif name.startswith("/"):
            files += rss
        elif (not name and perms.startswith("rw") and start % ARENA_BYTES == 0
              and end - start + reserved == ARENA_BYTES):
            arenas += rss
            count += 1
        else:
            other += rss
    return Anatomy(heap, arenas, count, other, files, psutil.Process(pid).num_threads())


class Sampler:
    """Whole-tree usage every ``SAMPLE_EVERY_S`` on a thread of its own, while a block runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[TreeUsage] = []
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(tree_usage(self.pid))
            except (FileNotFoundError, ProcessLookupError, psutil.Error):
                return
            self._stop.wait(SAMPLE_EVERY_S)

    @contextmanager
    def running(self) -> Iterator[Sampler]:
        thread = threading.Thread(target=self._run, name="pss-sampler", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()

    def peak(self) -> TreeUsage:
        return max(self.samples, key=lambda s: s.total.pss)


@dataclass(frozen=True)
class Moment:
    """The tree at one moment, what its files would cost alone, and the main process's
    anatomy."""

    tree: TreeUsage
    files: int
    anatomy: Anatomy

    @property
    def alone(self) -> int:
        """PSS as if nothing outside the tree shared its pages (see ``files_alone``)."""
        return self.tree.total.pss_anon + self.files


def moment(pid: int) -> Moment:
    """The quick readings first: on a busy machine the full smaps walks take seconds, and
    an idle release may come meanwhile."""
    tree, shape = tree_usage(pid), anatomy(pid)
    return Moment(tree, files_alone(pid), shape)


@dataclass
class Measurement:
    name: str
    ready: Moment
    peak: TreeUsage  # the sample with the highest whole-tree PSS
    peak_anon: int  # the highest whole-tree anonymous PSS sampled
    loaded: Moment  # right after the load
    idle: Moment
    load: list[LoadResult]
    idle_release_s: float | None = None  # how long after the load the release came
    warmup: str = ""

    @property
    def peak_alone(self) -> int:
        return self.peak_anon + self.loaded.files

    def statuses(self) -> str:
        counts: Counter[str] = Counter()
        for result in self.load:
            counts += result.statuses
        return ", ".join(f"{status}: {n}" for status, n in sorted(counts.items()))


async def _drive(url: str, concurrency: int, seconds: float) -> list[LoadResult]:
    """Closed-loop clients split over the photos, all at once."""
    shares = [concurrency // len(IMAGES) + (i < concurrency % len(IMAGES))
              for i in range(len(IMAGES))]
    return list(await asyncio.gather(*(run_load(url, image.read_bytes(), share, seconds)
                                       for image, share in zip(IMAGES, shares, strict=True)
                                       if share)))


def _wait_for_idle_release(base: str, limit_s: float) -> float | None:
    """Seconds until vramguard reports an idle release (None: none came in ``limit_s``)."""
    started = time.monotonic()
    with httpx.Client(base_url=base, timeout=10) as client:
        while time.monotonic() - started < limit_s:
            if client.get("/v1/memory").json()["idle_releases"] >= 1:
                return time.monotonic() - started
            time.sleep(0.2)
    return None


def _warmup(base: str) -> str:
    """The batch sizes vramguard's warmup ran (the largest leaves the most behind), and
    whether it ran them at all (a later start may reuse a stored profile)."""
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["models"][0]
    sizes = [t["batch_size"] for t in model.get("warmup", [])]
    reused = {True: ", profile reused", False: ", profile measured"}.get(
        model.get("profile_reused"), "")
    return f"warmup batches {sizes}, batch size {model.get('max_batch_size')}{reused}"


def measure(name: str, command: list[str], base: str, env: dict[str, str], cwd: Path,
            work: Path, args: argparse.Namespace, releases: bool) -> Measurement:
    with running(command, f"{base}/readyz", work / f"{name}.log", env, cwd=cwd) as process:
        time.sleep(args.quiet_s)  # decode workers finish starting; nothing else runs
        ready = moment(process.pid)
        sampler = Sampler(process.pid)
        with sampler.running():
            load = asyncio.run(_drive(f"{base}/v1/classify", args.concurrency, args.seconds))
        loaded = moment(process.pid)
        waited = (_wait_for_idle_release(base, args.idle_release_s + 30) if releases
                  else None)
        time.sleep(args.quiet_s if releases else args.idle_release_s + args.quiet_s)
        return Measurement(name, ready, sampler.peak(),
                           max(s.total.pss_anon for s in sampler.samples), loaded,
                           moment(process.pid), load, waited,
                           _warmup(base) if releases else "")


def _mib(n: int) -> str:
    return f"{n / MIB:.0f}"


def report(measurements: list[Measurement], args: argparse.Namespace) -> str:
    lines = [f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"load: {args.concurrency} clients for {args.seconds:.0f} s on "
             + ", ".join(p.name for p in IMAGES)
             + f"; idle release after {args.idle_release_s:g} s; vramguard env: "
             + (" ".join(args.env) or "-") + f"; tree: {args.tree}", "",
             "MiB; PSS alone = anonymous PSS + each mapped file once (what the tree would "
             "cost with nothing else running)", "",
             "| server | phase | procs | RSS | PSS | USS | anon PSS | PSS alone | main PSS | "
             "children PSS |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in measurements:
        rows = (("ready", m.ready.tree, m.ready.alone),
                ("peak under load", m.peak, m.peak_alone),
                ("after idle", m.idle.tree, m.idle.alone))
        for phase, tree, alone in rows:
            total = tree.total
            anon = m.peak_anon if tree is m.peak else total.pss_anon
            lines.append(f"| {m.name} | {phase} | {1 + len(tree.children)} | "
                         f"{_mib(total.rss)} | {_mib(total.pss)} | {_mib(total.uss)} | "
                         f"{_mib(anon)} | {_mib(alone)} | {_mib(tree.main.pss)} | "
                         + (" + ".join(_mib(c.pss) for c in tree.children) or "-") + " |")
    lines += ["", "main process by mapping (RSS MiB): heap / thread arena heaps (count) / other "
              "anon / files; threads", ""]
    for m in measurements:
        for phase, a in (("ready", m.ready.anatomy), ("after load", m.loaded.anatomy),
                         ("after idle", m.idle.anatomy)):
            lines.append(f"- {m.name}, {phase}: {_mib(a.heap)} / {_mib(a.arenas)} "
                         f"({a.arena_count}) / {_mib(a.other_anon)} / {_mib(a.files)}; "
                         f"{a.threads} threads")
    lines.append("")
    for m in measurements:
        rps = sum(r.requests_per_second for r in m.load)
        lines.append(f"- {m.name}: {rps:.1f} req/s; statuses {m.statuses()}"
                     + (f"; {m.warmup}" if m.warmup else "")
                     + (f"; idle release {m.idle_release_s:.1f} s after the load"
                        if m.idle_release_s is not None else ""))
    by = {m.name: m for m in measurements}
    if {"vramguard", "naive"} <= by.keys():
        ours, naive = by["vramguard"], by["naive"]
        lines += ["", f"peak PSS vramguard / naive: "
                  f"{ours.peak.total.pss / naive.peak.total.pss:.3f} (target <= 1.15); "
                  f"PSS alone: {ours.peak_alone / naive.peak_alone:.3f}; "
                  f"anon PSS: {ours.peak_anon / naive.peak_anon:.3f}"]
    if "vramguard" in by:
        ours = by["vramguard"]
        ready, idle = ours.ready.tree, ours.idle.tree
        lines += [f"vramguard RSS after idle / at ready: "
                  f"{idle.total.rss / ready.total.rss:.3f} (target <= 1.05); "
                  f"main process alone: {idle.main.rss / ready.main.rss:.3f}; "
                  f"PSS alone: {ours.idle.alone / ours.ready.alone:.3f}"]
        if ours.idle_release_s is None:
            lines.append("vramguard did NOT report an idle release")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="load per server")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--idle-release-s", type=float, default=5.0,
                        help="vramguard's idle_release_s for this run")
    parser.add_argument("--quiet-s", type=float, default=2.0,
                        help="pause before the ready and the after-idle figures")
    parser.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="extra environment for vramguard only (e.g. MALLOC_ARENA_MAX=2)")
    parser.add_argument("--tree", type=Path, default=ROOT,
                        help="the source tree both servers run from (a scratch worktree)")
    parser.add_argument("--servers", nargs="+", default=["naive", "vramguard"],
                        choices=["naive", "vramguard"])
    parser.add_argument("--profile-dir", type=Path,
                        help="vramguard's stored warmup profiles (default: a new folder, so "
                        "warmup measures as at a first start; reuse one for a later start)")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vramguard-memory-"))
    extra = dict(item.split("=", 1) for item in args.env)
    measurements = []
    for name in args.servers:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        if name == "naive":
            command = [sys.executable, "-m", "bench.naive_server", "--port", str(port)]
            measurements.append(measure(name, command, base, server_env(), args.tree, work,
                                        args, releases=False))
        else:
            command = [sys.executable, "-m", "app", "serve", "--log-level", "warning",
                       "--no-cache", "--port", str(port)]
            env = server_env(VRAMGUARD_IDLE_RELEASE_S=f"{args.idle_release_s:g}",
                             VRAMGUARD_RATE_LIMIT="0",
                             VRAMGUARD_CACHE_DIR=str(work / "cache"),
                             VRAMGUARD_TOKEN_FILE=str(work / "admin-token"),
                             VRAMGUARD_LOG_DIR=str(work / "logs"),
                             VRAMGUARD_PROFILE_DIR=str(args.profile_dir or work / "profiles"),
                             **extra)
            measurements.append(measure(name, command, base, env, args.tree, work, args,
                                        releases=True))
        print(f"  {name} done", flush=True)
    text = report(measurements, args)
    print("\n" + text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
