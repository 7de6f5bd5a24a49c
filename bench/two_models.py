"""Two models: one vramguard serving both vs. two single-model vramguards, interleaved.

    python -m bench.two_models [--seconds 20] [--rounds 3] [--concurrency 16]
                               [--fair-seconds 10] [--fair-rounds 3]

Setups, each under the same load (``--concurrency`` closed-loop clients per model, each
client sticking to its model; ``coffee.jpg``; result cache and rate limit off):

- **one**: one process, ``--model efficientnet_lite0 --models efficientnet_lite1``;
  each client names its model (``?model=``).
- **two**: today's way, one process per model on its own port; each client is sent to
  its model's process.

Rounds alternate (one, two, two, one, ...); each round starts its setup afresh, lets it
settle, measures, and stops it, so that nothing of the other setup is alive while one is
measured. All processes share one profile folder, filled by an untimed start first, so
every start reuses the same measured profiles (same batch sizes in both setups).

Memory is sampled every 0.25 s over the whole process tree(s) (decode workers
included): PSS summed over both processes for **two** (shared pages counted once), plus
USS (private pages only, which other programs mapping the same torch libraries cannot
split) and RSS.

Fairness (setup **one** only; ``--rounds 0`` runs only this): lite1 as a trickle (1
client) with and without lite0 at 32 clients, alternating; its p50 latency under load
over its p50 alone is the ratio. The loaded clients do not honour Retry-After: a 503
sends them straight back (``bench.loadgen``), and latency percentiles count every answer,
refusals included.

Prints tables and writes ``bench/results/two-models-<stamp>.{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench.loadgen import LoadResult, run_load
from bench.process import ROOT, free_port, process_tree, running, server_env
from bench.run import IMAGE, machine

MODELS = ("efficientnet_lite0", "efficientnet_lite1")
SAMPLE_S = 0.25
MiB = 1024**2


@dataclass
class TreeMemory:
    """Peaks of the summed memory of several process trees, sampled together."""

    pss: int = 0
    uss: int = 0
    rss: int = 0
    samples: int = 0

    def take(self, pids: list[int]) -> None:
        pss = uss = rss = 0
        for pid in pids:
            for member in process_tree(pid):
                info = member.memory_full_info()
                pss += getattr(info, "pss", info.uss)
                uss += info.uss
                rss += info.rss
        self.pss, self.uss, self.rss = max(self.pss, pss), max(self.uss, uss), max(self.rss, rss)
        self.samples += 1


def tree_memory(pids: list[int]) -> TreeMemory:
    """One reading of the summed memory of the trees of ``pids``."""
    reading = TreeMemory()
    reading.take(pids)
    return reading


async def _watch(pids: list[int], memory: TreeMemory, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            await asyncio.to_thread(memory.take, pids)
        except psutil.Error:
            return
        await asyncio.sleep(SAMPLE_S)


async def _load(targets: dict[str, tuple[str, int]], body: bytes, seconds: float,
                pids: list[int], memory: TreeMemory | None = None) -> dict[str, LoadResult]:
    """Closed-loop load on every (url, concurrency) of ``targets`` at once."""
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch(pids, memory, stop)) if memory is not None else None
    names = list(targets)
    results = await asyncio.gather(*(run_load(targets[n][0], body, targets[n][1], seconds)
                                     for n in names))
    stop.set()
    if watcher is not None:
        await watcher
    return dict(zip(names, results, strict=True))


def _command(port: int, model: str, more: str | None = None) -> list[str]:
    return [sys.executable, "-m", "app", "serve", "--log-level", "warning", "--no-cache",
            "--port", str(port), "--model", model, *(["--models", more] if more else [])]


@contextmanager
def serving(setup: str, work: Path, env: dict[str, str], tag: str
            ) -> Iterator[tuple[dict[str, str], list[int]]]:
    """Start ``setup`` ("one" or "two"); yield each model's classify URL and the pids."""
    with ExitStack() as stack:
        urls: dict[str, str] = {}
        pids: list[int] = []
        plan = ([(MODELS[0], ",".join(MODELS[1:]), MODELS)] if setup == "one" else
                [(m, None, (m,)) for m in MODELS])
        for primary, more, served in plan:
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            process = stack.enter_context(running(
                _command(port, primary, more), f"{base}/readyz",
                work / f"{setup}-{primary}-{tag}.log",
                {**env, "VRAMGUARD_CACHE_DIR": str(work / f"cache-{setup}-{primary}")}))
            pids.append(process.pid)
            for model in served:
                urls[model] = f"{base}/v1/classify?model={model}"
        yield urls, pids


@dataclass
class Pooled:
    per_model: dict[str, LoadResult] = field(default_factory=dict)
    memory: list[TreeMemory] = field(default_factory=list)

    def add(self, results: dict[str, LoadResult], memory: TreeMemory) -> None:
        for name, r in results.items():
            self.per_model[name] = self.per_model[name].merge(r) if name in self.per_model else r
        self.memory.append(memory)

    def throughput(self) -> float:
        """Images per second of all models together (200 answers only)."""
        return sum(r.ok / r.seconds for r in self.per_model.values() if r.seconds)

    def errors(self) -> int:
        return sum(r.errors for r in self.per_model.values())

    def peak(self, kind: str) -> int:
        return int(max(getattr(m, kind) for m in self.memory))


def _round_line(setup: str, index: int, results: dict[str, LoadResult],
                memory: TreeMemory) -> str:
    total = sum(r.requests_per_second for r in results.values())
    parts = ", ".join(f"{n.removeprefix('efficientnet_')} {r.requests_per_second:.1f}"
                      for n, r in results.items())
    return (f"  round {index + 1} {setup:<3} {total:6.1f} img/s ({parts}), errors "
            f"{sum(r.errors for r in results.values())}, peak PSS {memory.pss / MiB:.0f} MiB, "
            f"load average {psutil.getloadavg()[0]:.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="measured seconds per setup and round")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds per setup (0: fairness only)")
    parser.add_argument("--concurrency", type=int, default=16, help="clients per model")
    parser.add_argument("--settle-seconds", type=float, default=3.0,
                        help="unmeasured load after each start (lazy costs, decode workers)")
    parser.add_argument("--fair-seconds", type=float, default=10.0,
                        help="per fairness phase and round (0: skip fairness)")
    parser.add_argument("--fair-rounds", type=int, default=3)
    parser.add_argument("--fair-load", type=int, default=32, help="lite0 clients")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vramguard-two-models-"))
    env = server_env(VRAMGUARD_RATE_LIMIT="0", VRAMGUARD_PROFILE_DIR=str(work / "profiles"))
    body = IMAGE.read_bytes()
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"machine: {machine()}", flush=True)
    print(f"load average at start: {psutil.getloadavg()}", flush=True)

    with serving("one", work, env, "profiles"):  # untimed: measures and stores the profiles
        pass
    profiles = sorted(p.name for p in (work / "profiles").glob("*.json"))
    print(f"profiles stored: {len(profiles)}", flush=True)

    pooled = {"one": Pooled(), "two": Pooled()}
    rounds: list[dict[str, object]] = []
    for index in range(args.rounds):
        order = ["one", "two"] if index % 2 == 0 else ["two", "one"]
        for setup in order:
            with serving(setup, work, env, f"r{index}") as (urls, pids):
                settle = {m: (urls[m], 2) for m in MODELS}
                asyncio.run(_load(settle, body, args.settle_seconds, pids))
                memory = TreeMemory()
                targets = {m: (urls[m], args.concurrency) for m in MODELS}
                results = asyncio.run(_load(targets, body, args.seconds, pids, memory))
            pooled[setup].add(results, memory)
            print(_round_line(setup, index, results, memory), flush=True)
            rounds.append({"round": index + 1, "setup": setup,
                           "total_rps": sum(r.requests_per_second for r in results.values()),
                           "rps": {m: r.requests_per_second for m, r in results.items()},
                           "errors": {m: dict(r.statuses) for m, r in results.items()},
                           "peak_pss": memory.pss, "peak_uss": memory.uss,
                           "peak_rss": memory.rss, "samples": memory.samples,
                           "load_average_1min": psutil.getloadavg()[0]})

    fairness: dict[str, LoadResult] = {}
    loaded_lite0: LoadResult | None = None
    if args.fair_seconds > 0:
        with serving("one", work, env, "fairness") as (urls, pids):
            asyncio.run(_load({m: (urls[m], 2) for m in MODELS}, body, args.settle_seconds,
                              pids))
            for index in range(args.fair_rounds):
                order = ["alone", "loaded"] if index % 2 == 0 else ["loaded", "alone"]
                for phase in order:
                    targets = {MODELS[1]: (urls[MODELS[1]], 1)}
                    if phase == "loaded":
                        targets[MODELS[0]] = (urls[MODELS[0]], args.fair_load)
                    results = asyncio.run(_load(targets, body, args.fair_seconds, pids))
                    trickle = results[MODELS[1]]
                    fairness[phase] = (fairness[phase].merge(trickle) if phase in fairness
                                       else trickle)
                    if phase == "loaded":
                        lite0 = results[MODELS[0]]
                        loaded_lite0 = loaded_lite0.merge(lite0) if loaded_lite0 else lite0
                    print(f"  fairness round {index + 1} {phase:<6} trickle p50 "
                          f"{trickle.percentile(50) * 1000:.0f} ms ({trickle.ok} answers, "
                          f"errors {trickle.errors})", flush=True)

    lines = [f"date: {started_at}", f"machine: {machine()}",
             f"load average at the end: {psutil.getloadavg()}"]
    summary: dict[str, object] = {}
    if args.rounds > 0:
        lines += [f"models: {', '.join(MODELS)}; {args.concurrency} clients per model; "
                  f"{args.seconds:.0f} s per setup and round, {args.rounds} rounds each, "
                  "interleaved; coffee.jpg; cache and rate limit off; shared, warm profiles; "
                  "latency percentiles count every answer (503 refusals too)",
                  "", "| setup | img/s (all) | " + " | ".join(
                      f"{m.removeprefix('efficientnet_')} img/s | p50 ms | p99 ms"
                      for m in MODELS)
                  + " | errors | peak PSS MiB | peak USS MiB | peak RSS MiB |",
                  "| --- | --- | " + " | ".join("--- | --- | ---" for _ in MODELS)
                  + " | --- | --- | --- | --- |"]
        for setup, p in pooled.items():
            cells = [setup, f"{p.throughput():.1f}"]
            for m in MODELS:
                r = p.per_model[m]
                cells += [f"{r.requests_per_second:.1f}", f"{r.percentile(50) * 1000:.0f}",
                          f"{r.percentile(99) * 1000:.0f}"]
            cells += [str(p.errors()), f"{p.peak('pss') / MiB:.0f}",
                      f"{p.peak('uss') / MiB:.0f}", f"{p.peak('rss') / MiB:.0f}"]
            lines.append("| " + " | ".join(cells) + " |")
        one, two = pooled["one"], pooled["two"]
        ratio = one.throughput() / two.throughput()
        per_round = [f"{r['setup']} {r['total_rps']:.1f}" for r in rounds]
        lines += ["", f"throughput one / two: **{ratio:.3f}** (target >= 1.0); "
                  f"peak PSS one / two: **{one.peak('pss') / two.peak('pss'):.3f}**, "
                  f"USS {one.peak('uss') / two.peak('uss'):.3f}, "
                  f"RSS {one.peak('rss') / two.peak('rss'):.3f}",
                  "per round (img/s): " + ", ".join(per_round)]
        summary = {"throughput_ratio": ratio, "pss_ratio": one.peak("pss") / two.peak("pss")}
    if fairness:
        alone, loaded = fairness["alone"], fairness["loaded"]
        fair = loaded.percentile(50) / alone.percentile(50)
        summary["fairness_p50_ratio"] = fair
        lines += ["", f"fairness (one process): {MODELS[1]} at 1 client, alone vs. with "
                  f"{MODELS[0]} at {args.fair_load} clients; {args.fair_seconds:.0f} s per "
                  f"phase and round, {args.fair_rounds} rounds alternating", "",
                  "| trickle | answers | p50 ms | p90 ms | p99 ms | errors |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for phase, r in fairness.items():
            lines.append(f"| {phase} | {r.ok} | {r.percentile(50) * 1000:.0f} | "
                         f"{r.percentile(90) * 1000:.0f} | {r.percentile(99) * 1000:.0f} | "
                         f"{r.errors} |")
        if loaded_lite0 is not None:
            lines += ["", f"lite0 meanwhile: {loaded_lite0.requests_per_second:.1f} img/s, "
                      f"p50 {loaded_lite0.percentile(50) * 1000:.0f} ms, errors "
                      f"{loaded_lite0.errors}",
                      f"trickle p50 loaded / alone: **{fair:.2f}**"]
    report = "\n".join(lines)
    print("\n" + report)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    (args.out / f"two-models-{stamp}.md").write_text(report + "\n")

    def described(r: LoadResult) -> dict[str, object]:
        return {"rps": r.requests_per_second, "ok": r.ok, "seconds": r.seconds,
                "p50": r.percentile(50), "p90": r.percentile(90), "p99": r.percentile(99),
                "statuses": dict(r.statuses)}

    (args.out / f"two-models-{stamp}.json").write_text(json.dumps({
        "date": started_at, "machine": machine(), "args": {k: str(v) for k, v in
                                                          vars(args).items()},
        "setups": {s: {"throughput": p.throughput(), "errors": p.errors(),
                       "peak_pss": p.peak("pss"), "peak_uss": p.peak("uss"),
                       "peak_rss": p.peak("rss"),
                       "models": {m: described(r) for m, r in p.per_model.items()}}
                   for s, p in pooled.items() if p.memory},
        "rounds": rounds, "summary": summary,
        "fairness": {phase: described(r) for phase, r in fairness.items()},
        "fairness_lite0": described(loaded_lite0) if loaded_lite0 else None}, indent=2))
    print(f"\nwritten: {args.out / f'two-models-{stamp}.md'} and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
