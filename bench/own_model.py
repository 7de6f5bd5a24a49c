"""An own timm model served by vramguard against the same model run in-process.

    python -m bench.own_model [--concurrency 1 8 32] [--seconds 48] [--rounds 6]

The model is the worked example's (``docs/own_models/train_timm.py``: ``train_model(0)``,
a 64 x 64 red/green/blue shapes classifier), written as a ``timm`` folder (safetensors
weights + ``vramguard.toml``) and added as ``shapes`` to a temporary models folder with
``OwnModels.add``, trial included, as ``vramguard models add`` does. Then, in one run:

- **offline limit** (``bench.offline``): the model as vramguard loads it
  (``ModelSources.load``), decode + preprocess + forward in a tight loop at batch 1 to 32
  (the server's warmup may choose 32 for a model this small), with one torch thread and
  with every core (the server chooses between the two batch by batch); each setting
  pooled over the rounds, the best one counts;
- **served**: ``vramguard serve --model shapes --no-cache --keep-alive-s -1`` on that
  models folder, under ``bench.loadgen``'s closed-loop load on
  ``/v1/classify?model=shapes``; the rounds start once its batch sizes are measured.

Every request and every offline pass uses the same bytes: one drawn shapes picture as a
JPEG. Each round measures the offline limit and every concurrency, in an order that
reverses from round to round, so the machine's drift slows both alike; the ratio is the
pooled served throughput over the pooled offline limit. Peak memory is the PSS of the
server's whole process tree (decode workers included), sampled during the load.

The naive server is left out: ``bench/naive_server.py`` builds built-in models only
(``app.models.load_model``), so it cannot serve this one.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import io
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import safetensors.torch
import torch

from app.models import LoadedModel
from app.models.own.store import OwnModels
from app.models.sources import ModelSources
from bench.loadgen import LoadResult, run_load, tree_pss
from bench.offline import offline_limit
from bench.process import ROOT, free_port, running, server_env
from bench.run import machine

NAME = "shapes"
EXAMPLES = ROOT / "docs" / "own_models"
OFFLINE = "offline"
SIZES = (1, 2, 4, 8, 16, 32)  # the offline limit's batch sizes


Offline = dict[tuple[int, int], float]  # (torch threads, batch size): images per second


def offline_round(model: LoadedModel, image: bytes, thread_counts: tuple[int, ...],
                  seconds: float) -> Offline:
    """``bench.offline``'s limit at each torch thread count (the server picks its count
    batch by batch; on a busy 2-core machine one thread can beat two many times over
    for a model this small), restoring the count it found."""
    found = torch.get_num_threads()
    measured: Offline = {}
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for r in offline_limit(model, image, SIZES, seconds)[1]:
                measured[(threads, r.batch_size)] = r.images_per_second
    finally:
        torch.set_num_threads(found)
    return measured


def pool_offline(rounds: list[Offline]) -> Offline:
    """Each setting's mean over the rounds (every round measures each for the same time,
    so the mean is the pooled rate)."""
    return {key: sum(one[key] for one in rounds) / len(rounds) for key in rounds[0]}


def best(measured: Offline) -> tuple[tuple[int, int], float]:
    """The fastest setting and its images per second: the offline limit."""
    return max(measured.items(), key=lambda item: item[1])


def _example(name: str) -> ModuleType:
    """A module of the worked examples, which import each other by their bare names."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


def _model_folder(out: Path) -> Path:
    """The trained example model as a ``timm`` folder (what ``save_all`` writes for it)."""
    train_timm, saving = _example("train_timm"), _example("saving")
    threads = torch.get_num_threads()  # training pins one thread; the limit needs them all
    model = train_timm.train_model(0)
    torch.set_num_threads(threads)
    folder = out / "timm"
    folder.mkdir(parents=True)
    safetensors.torch.save_file(model.state_dict(), folder / "weights.safetensors")
    saving.write_manifest(folder, format="timm", file="weights.safetensors",
                          architecture=train_timm.ARCHITECTURE)
    return folder


def _picture() -> bytes:
    """One drawn shapes picture, as the JPEG a client would upload."""
    image = _example("shapes_data").make_images(1, seed=1)[0][0]
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def _rounds(offline: Callable[[], Offline], load: Callable[[int], LoadResult],
            levels: list[int], rounds: int) -> tuple[list[Offline], dict[int, LoadResult]]:
    """Every measurement, round by round, in an order that reverses each round."""
    offline_rounds: list[Offline] = []
    served: dict[int, LoadResult] = {}
    steps: list[int | str] = [OFFLINE, *levels]
    for round_ in range(rounds):
        for step in steps if round_ % 2 == 0 else reversed(steps):
            if isinstance(step, str):
                offline_rounds.append(offline())
                (threads, size), rate = best(offline_rounds[-1])
                print(f"  round {round_ + 1} offline  {rate:7.1f} img/s (batch {size}, "
                      f"{threads} thread{'s' if threads > 1 else ''})", flush=True)
                continue
            result = load(step)
            served[step] = served[step].merge(result) if step in served else result
            print(f"  round {round_ + 1} c={step:<3}    {result.requests_per_second:7.1f} "
                  f"img/s, errors {result.errors}", flush=True)
    return offline_rounds, served


def _report(args: argparse.Namespace, offline_rounds: list[Offline],
            served: dict[int, LoadResult], server: dict[str, Any], before: int,
            load_before: str) -> str:
    pooled = pool_offline(offline_rounds)
    (threads, size), limit = best(pooled)
    lines = [f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"machine: {machine()}; load average before (1 / 5 / 15 min): {load_before}",
             f"model: docs/own_models timm example ({NAME}, timm folder); picture: one "
             f"drawn 64x64 JPEG; {args.seconds:.0f} s per level and for the offline limit, "
             f"in {args.rounds} interleaved rounds; cache off",
             f"server: batch size {server.get('batch_size')}, profile complete "
             f"{server.get('profile_complete')}, warmup's own figure "
             f"{server.get('images_per_second')} img/s",
             f"offline limit (pooled): {limit:.1f} img/s at batch {size}, {threads} "
             "thread(s)",
             *(f"  {t} thread(s): " + ", ".join(f"b{b} {rate:.1f}" for (t2, b), rate
                                                 in pooled.items() if t2 == t)
               for t in sorted({t for t, _ in pooled})),
             "", "| c | served img/s | p50 ms | p99 ms | errors | served / offline | "
             "peak PSS MiB |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for level, r in served.items():
        lines.append(f"| {level} | {r.requests_per_second:.1f} | "
                     f"{r.percentile(50) * 1000:.1f} | {r.percentile(99) * 1000:.1f} | "
                     f"{r.errors} | {r.requests_per_second / limit:.3f} | "
                     f"{r.peak_pss_bytes / 1024**2:.0f} |")
    peak = max(r.peak_pss_bytes for r in served.values())
    lines += ["", f"peak PSS of the server's process tree: {peak / 1024**2:.0f} MiB "
              f"({before / 1024**2:.0f} MiB idle, {NAME} loaded)"]
    return "\n".join(lines)


def _served(url: str, body: bytes, timeout_s: float = 300) -> dict[str, Any]:
    """Ask for the model until it answers and its batch sizes are measured (until then it
    runs one picture per batch); its ``/v1/models`` entry."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=60) as client:
        while time.monotonic() < deadline:
            answer = client.post(f"/v1/classify?model={NAME}", content=body,
                                 headers={"Content-Type": "image/jpeg"})
            listed = client.get("/v1/models").json()["models"]
            entry: dict[str, Any] = next(m for m in listed if m["name"] == NAME)
            if answer.status_code == 200 and entry.get("profile_complete"):
                return entry
            time.sleep(0.5)
    raise RuntimeError(f"{NAME} was not served with its profile in {timeout_s:.0f} s")


def _loaded(models_dir: Path) -> LoadedModel:
    """The model as the server builds it."""
    return ModelSources(OwnModels(models_dir)).load(NAME, torch.device("cpu"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=48.0,
                        help="per level, and for the offline limit, split over the rounds")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=0,
                        help="pin the server's batch size (0: warmup's choice)")
    args = parser.parse_args()
    load_before = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    work = Path(tempfile.mkdtemp(prefix="vramguard-own-model-"))
    print(f"machine: {machine()}", flush=True)
    models_dir = work / "models"
    OwnModels(models_dir).add(_model_folder(work), NAME)
    model, body = _loaded(models_dir), _picture()
    thread_counts = tuple(sorted({1, torch.get_num_threads()}))
    per_size = args.seconds / args.rounds / (len(SIZES) * len(thread_counts))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = server_env(VRAMGUARD_MODELS_DIR=str(models_dir), VRAMGUARD_RATE_LIMIT="0",
                     VRAMGUARD_CACHE_DIR=str(work / "cache"),
                     VRAMGUARD_PROFILE_DIR=str(work / "profiles"))
    command = [sys.executable, "-m", "app", "serve", "--log-level", "warning", "--no-cache",
               "--port", str(port), "--model", NAME, "--keep-alive-s", "-1",
               *(["--batch-size", str(args.batch_size)] if args.batch_size else [])]
    with running(command, f"{url}/readyz", work / "serve.log", env) as process:
        time.sleep(3)  # the model's warmup leaves memory that settles
        before = tree_pss(process.pid)
        classify = f"{url}/v1/classify?model={NAME}"
        server = _served(url, body)
        asyncio.run(run_load(classify, body, 2, 2.0, process.pid))  # one-off costs

        def load(level: int) -> LoadResult:
            return asyncio.run(run_load(classify, body, level, args.seconds / args.rounds,
                                        process.pid))

        offline_rounds, served = _rounds(
            lambda: offline_round(model, body, thread_counts, per_size), load,
            args.concurrency, args.rounds)
    print("\n" + _report(args, offline_rounds, served, server, before, load_before))
    print(f"server log and model folder: {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
