"""Start time: launch to ``/readyz`` 200, vramguard (first and second start) vs. naive.

    python -m bench.start_time [--rounds 4] [--settle 2]

Per round, in an order that rotates from round to round (a machine that drifts slows
every kind alike), one launch of each:

- **first**: ``python -m app serve`` on its default model with an empty profile folder
  (warmup profiles the batch sizes and stores the profile);
- **second**: the same with a profile folder filled by an untimed start before the
  rounds (the profile is reused: one forward pass instead of profiling);
- **naive**: ``python -m bench.naive_server`` (imports, model load, listens; no forward
  pass before its first request);
- **phases**: not a server: ``python -m bench.start_time --phases`` times in one fresh
  process what a start is made of (interpreter, ``import torch``, the app's other
  imports, the model load, the first and a second forward pass of one image, one decode
  worker's spawn and first decode), to say where the time goes.

Each server launch records launch → ``/readyz`` 200 (``bench.process.running`` polls it
every 0.2 s, so add up to 0.2 s to every kind alike) and launch → the first
``/v1/classify`` 200 (one request sent right after ready), then, ``--settle`` s later,
the RSS, PSS and USS of the whole process tree and its summed peak RSS (VmHWM, which
includes warmup). vramguard's log (info level) gives when its imports ended ("starting"),
uvicorn was up, and the model was ready, as offsets from the launch.

Prints tables and writes ``bench/results/start-time-<stamp>.{md,json}``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

KINDS = ("first", "second", "naive", "phases")
MiB = 1024**2
LOG_MARKS = {  # vramguard log line fragment -> what it marks
    " starting; log file": "imports done",
    "Application startup complete": "uvicorn up",
    "INFO vramguard.engine: ready:": "model ready",
}


def phases() -> dict[str, float]:
    """In this fresh process: time.time() at the end of each step of a start."""
    marks = {"interpreter up": time.time()}
    import torch

    marks["import torch"] = time.time()
    # what serving imports
    for module in ("app.cli.main", "app.cli.process_control", "app.http.server"):
        importlib.import_module(module)
    from app.config import load_settings
    from app.engine.predictor import Predictor
    from app.http.server import make_decoder
    from app.models import DEFAULT_MODEL, load_model

    marks["app imports (fastapi, uvicorn, pydantic, ...)"] = time.time()
    settings = load_settings(None)
    model = load_model(DEFAULT_MODEL, torch.device("cpu"))
    marks["model load"] = time.time()
    predictor = Predictor(model, keep_all=False)
    predictor(predictor.random_batch(1))
    marks["first forward pass (1 image)"] = time.time()
    predictor(predictor.random_batch(1))
    marks["second forward pass (1 image)"] = time.time()
    decoder = make_decoder(settings, 1)
    decoder.start()
    image = (Path(__file__).resolve().parent.parent / "tests" / "data" / "coffee.jpg")
    decoder.decode(image.read_bytes(), model.preprocessing, time.monotonic() + 60)
    marks["decode worker spawn + first decode"] = time.time()
    decoder.close()
    return marks


def _log_marks(log: Path, launched: float) -> dict[str, float]:
    """Seconds from the launch to each of LOG_MARKS in a vramguard log (local times)."""
    found: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        for fragment, name in LOG_MARKS.items():
            if fragment in line and name not in found:
                stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                found[name] = stamp - launched
    return found


def _peak_rss(pids: list[int]) -> int:
    """Summed VmHWM (peak resident set) of ``pids``."""
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) * 1024
    return total


def _launch(kind: str, index: int, work: Path, env: dict[str, str], settle: float,
            body: bytes) -> dict[str, Any]:
    import httpx

    from bench.process import free_port, process_tree, running
    from bench.two_models import tree_memory

    if kind == "phases":
        launched = time.time()
        out = subprocess.run([sys.executable, "-m", "bench.start_time", "--phases"],
                             env=env, capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent.parent)
        marks = json.loads(out.stdout.strip().splitlines()[-1])
        return {"kind": kind, "round": index,
                "marks": {name: at - launched for name, at in marks.items()}}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    if kind == "naive":
        command = [sys.executable, "-m", "bench.naive_server", "--port", str(port)]
        folder = work / "profiles-unused"
    else:
        command = [sys.executable, "-m", "app", "serve", "--log-level", "info", "--no-cache",
                   "--port", str(port)]
        folder = work / ("profiles" if kind == "second" else f"profiles-first-{index}")
    run_env = {**env, "VRAMGUARD_PROFILE_DIR": str(folder),
               "VRAMGUARD_CACHE_DIR": str(work / f"cache-{kind}-{index}")}
    log = work / f"{kind}-{index}.log"
    launched, started = time.time(), time.perf_counter()
    with running(command, f"{base}/readyz", log, run_env) as process:
        ready = time.perf_counter() - started
        answer = httpx.post(f"{base}/v1/classify", content=body,
                            headers={"Content-Type": "image/jpeg"}, timeout=60)
        first = time.perf_counter() - started
        time.sleep(settle)
        memory = tree_memory([process.pid])
        peak_rss = _peak_rss([m.pid for m in process_tree(process.pid)])
    row: dict[str, Any] = {"kind": kind, "round": index, "ready_s": ready,
                           "load_average_1min": os.getloadavg()[0],
                           "first_answer_s": first, "first_status": answer.status_code,
                           "rss": memory.rss, "pss": memory.pss, "uss": memory.uss,
                           "peak_rss": peak_rss}
    if kind != "naive":
        row["marks"] = _log_marks(log, launched)
        row["profile_reused"] = "profile reused" in log.read_text(errors="replace")
    return row


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds after the first answer before memory is read")
    parser.add_argument("--phases", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.phases:
        print(json.dumps(phases()))
        return 0

    import psutil

    from bench.process import ROOT, server_env
    from bench.run import IMAGE, machine

    out = args.out or ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vramguard-start-"))
    env = server_env(VRAMGUARD_RATE_LIMIT="0")
    body = IMAGE.read_bytes()
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"machine: {machine()}; load average {psutil.getloadavg()}", flush=True)
    # Untimed: fills the profile folder of "second", and the page cache for every kind.
    for kind in ("second", "naive"):
        _launch(kind, -1, work, env, 0, body)
    rows: list[dict[str, Any]] = []
    for index in range(args.rounds):
        order = KINDS[index % len(KINDS):] + KINDS[:index % len(KINDS)]
        for kind in order:
            row = _launch(kind, index, work, env, args.settle, body)
            rows.append(row)
            if kind == "phases":
                print(f"  round {index + 1} phases: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in row["marks"].items()), flush=True)
            else:
                print(f"  round {index + 1} {kind:<6} ready {row['ready_s']:.2f} s, first "
                      f"answer {row['first_answer_s']:.2f} s ({row['first_status']}), PSS "
                      f"{row['pss'] / MiB:.0f} MiB, peak RSS {row['peak_rss'] / MiB:.0f} MiB, "
                      f"load {row['load_average_1min']:.1f}"
                      + (f", log {row['marks']}" if "marks" in row else ""), flush=True)

    by = {k: [r for r in rows if r["kind"] == k] for k in KINDS}
    lines = [f"date: {started_at}", f"machine: {machine()}",
             f"load average at the end: {psutil.getloadavg()}",
             f"{args.rounds} rounds, order rotating; vramguard `python -m app serve "
             "--no-cache` on its default model; naive `python -m bench.naive_server`; "
             "readiness polled every 0.2 s", "",
             "| kind | ready s (median) | ready s (all) | first answer s (median) | "
             "RSS MiB | PSS MiB | USS MiB | peak RSS MiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for kind in ("first", "second", "naive"):
        rs = by[kind]
        lines.append(f"| {kind} | {_median(rs, 'ready_s'):.2f} | "
                     + ", ".join(f"{r['ready_s']:.2f}" for r in rs)
                     + f" | {_median(rs, 'first_answer_s'):.2f} | "
                     + " | ".join(f"{_median(rs, k) / MiB:.0f}"
                                  for k in ("rss", "pss", "uss", "peak_rss")) + " |")
    second, naive = _median(by["second"], "ready_s"), _median(by["naive"], "ready_s")
    answer_gap = (_median(by["second"], "first_answer_s")
                  - _median(by["naive"], "first_answer_s"))
    lines += ["", f"second start - naive (medians): **{second - naive:+.2f} s** "
              "(target <= +1.0 s); per round: " + ", ".join(
                  f"{s['ready_s'] - n['ready_s']:+.2f}"
                  for s, n in zip(by["second"], by["naive"], strict=True)),
              f"first answer, second start - naive (medians): {answer_gap:+.2f} s",
              f"profile reused in every second start: "
              f"{all(r['profile_reused'] for r in by['second'])}; in no first start: "
              f"{not any(r['profile_reused'] for r in by['first'])}",
              "", "vramguard's log, seconds from the launch (medians):", "",
              "| kind | " + " | ".join(LOG_MARKS.values()) + " | /readyz 200 seen |",
              "| --- | " + " | ".join("---" for _ in LOG_MARKS) + " | --- |"]
    for kind in ("first", "second"):
        rs = by[kind]
        lines.append(f"| {kind} | " + " | ".join(
            f"{statistics.median(r['marks'].get(m, float('nan')) for r in rs):.2f}"
            for m in LOG_MARKS.values()) + f" | {_median(rs, 'ready_s'):.2f} |")
    names = list(by["phases"][0]["marks"])
    lines += ["", "where a start's time goes (`--phases`, one fresh process; seconds, "
              "median; step = since the previous mark):", "",
              "| step | ends at s | step s |", "| --- | --- | --- |"]
    previous = 0.0
    for name in names:
        at = statistics.median(r["marks"][name] for r in by["phases"])
        lines.append(f"| {name} | {at:.2f} | {at - previous:.2f} |")
        previous = at
    report = "\n".join(lines)
    print("\n" + report)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    (out / f"start-time-{stamp}.md").write_text(report + "\n")
    (out / f"start-time-{stamp}.json").write_text(json.dumps(
        {"date": started_at, "machine": machine(), "rows": rows}, indent=2))
    print(f"\nwritten: {out / f'start-time-{stamp}.md'} and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
