"""The speed steps: where a batch's time goes, and what the engine's own readings cost.

split_timings (input build, H2D, forward, top-k), throughput (images/s, GPU utilisation),
tick_cost (the once-a-second memory reading), snapshot_cost (allocator history) and
latency_p50 (one request at a time, with a 0 ms and a 2 ms batch wait).
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

from bench.gpu_check.runner import percentile, timed_calls
from bench.gpu_check.state import Check, Nvml


@contextlib.contextmanager
def sampling_utilisation(nvml: Nvml | None) -> Iterator[list[tuple[int, int]]]:
    """NVML's GPU and memory-controller utilisation every 50 ms while the body runs."""
    samples: list[tuple[int, int]] = []
    if nvml is None:
        yield samples
        return
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.05):
            try:
                rates = nvml.lib.nvmlDeviceGetUtilizationRates(nvml.handle)
            except Exception:
                return
            samples.append((int(rates.gpu), int(rates.memory)))

    thread = threading.Thread(target=loop, name="gpu-check-utilisation", daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join(1.0)


def split_timings(check: Check, out: dict[str, Any]) -> str:
    import torch

    runtime = check.runtime
    predictor, module = runtime.predictor, runtime.model.module
    rows: list[dict[str, Any]] = []
    out["rows"] = rows
    for n in sorted({1, check.chosen, max(check.tried)}):
        reps: dict[str, list[float]] = {}

        def note(key: str, ms: float, reps: dict[str, list[float]] = reps) -> None:
            reps.setdefault(key, []).append(ms)

        for _ in range(check.plan.repeats):
            started = time.perf_counter()
            batch = predictor.random_batch(n)
            note("input_build_ms", (time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            stacked = torch.stack([s.pixels for s in batch])
            note("stack_ms", (time.perf_counter() - started) * 1000)
            if check.cuda:
                events = [torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                          for _ in range(6)]  # torch leaves Event's __init__ unannotated
                events[0].record()
                on_device = stacked.to(check.dev)
                events[1].record()
                started = time.perf_counter()
                pinned = stacked.pin_memory()
                note("pin_ms", (time.perf_counter() - started) * 1000)
                events[2].record()
                pinned.to(check.dev, non_blocking=True)
                events[3].record()
                with torch.inference_mode():
                    logits = module(on_device)
                    events[4].record()
                    scores, indices = logits.float().softmax(dim=-1).topk(5, dim=-1)
                    scores.cpu(), indices.cpu()
                events[5].record()
                torch.cuda.synchronize(check.dev)
                note("h2d_pageable_ms", events[0].elapsed_time(events[1]))
                note("h2d_pinned_ms", events[2].elapsed_time(events[3]))
                note("forward_ms", events[3].elapsed_time(events[4]))
                note("topk_d2h_ms", events[4].elapsed_time(events[5]))
            else:
                with torch.inference_mode():
                    started = time.perf_counter()
                    logits = module(stacked)
                    note("forward_ms", (time.perf_counter() - started) * 1000)
                    started = time.perf_counter()
                    logits.float().softmax(dim=-1).topk(5, dim=-1)
                    note("topk_d2h_ms", (time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            predictor(batch)
            check.sync()
            note("predictor_call_ms", (time.perf_counter() - started) * 1000)
        row: dict[str, Any] = {"batch": n, **{k: round(statistics.median(v), 3)
                                              for k, v in reps.items()}}
        row["images_per_s_forward"] = round(n / (row["forward_ms"] / 1000), 1)
        row["images_per_s_call"] = round(n / (row["predictor_call_ms"] / 1000), 1)
        rows.append(row)
    if not check.cuda:
        out["h2d"] = "no host-to-device copy on the CPU; forward timed with perf_counter"
    top = rows[-1]
    return (f"batch {top['batch']}: build {top['input_build_ms']:.1f} ms, forward "
            f"{top['forward_ms']:.1f} ms, call {top['predictor_call_ms']:.1f} ms")


def throughput(check: Check, out: dict[str, Any]) -> str:
    predictor = check.runtime.predictor
    rows: list[dict[str, Any]] = []
    out["rows"] = rows
    for n in sorted({check.chosen, max(check.tried)}):
        batch = check.samples(n)
        predictor(batch)
        seconds = min(check.plan.seconds, max(0.2, check.steps.remaining() / 20))
        with sampling_utilisation(check.nvml) as utilisation:
            done, started = 0, time.perf_counter()
            while time.perf_counter() - started < seconds:
                predictor(batch)
                done += n
            elapsed = time.perf_counter() - started
        row: dict[str, Any] = {"batch": n, "seconds": round(elapsed, 2),
                               "images_per_s": round(done / elapsed, 1)}
        if utilisation:
            gpu = [g for g, _ in utilisation]
            row["utilisation"] = {"samples": len(gpu), "gpu_mean_pct": round(
                statistics.mean(gpu), 1), "gpu_min_pct": min(gpu), "gpu_max_pct": max(gpu),
                "memory_mean_pct": round(statistics.mean(m for _, m in utilisation), 1)}
        else:
            row["utilisation"] = "not sampled: NVML is not available here"
        rows.append(row)
    return "; ".join(f"batch {r['batch']}: {r['images_per_s']} img/s" for r in rows)


def tick_cost(check: Check, out: dict[str, Any]) -> str:
    probe, calls = check.runtime.probe, check.plan.tick_calls
    out["probe_read"] = timed_calls(probe.read, calls)
    out["engine_tick"] = timed_calls(check.engine.tick, calls)
    out["source"] = probe.read().source
    if check.cuda_ready:
        import torch

        cuda, dev = torch.cuda, check.dev
        out["mem_get_info"] = timed_calls(lambda: cuda.mem_get_info(dev), calls)
        out["memory_stats"] = timed_calls(lambda: cuda.memory_stats(dev), calls)
    nvml = check.nvml
    if nvml is not None:
        lib, handle = nvml.lib, nvml.handle
        out["nvml_memory_info"] = timed_calls(lambda: lib.nvmlDeviceGetMemoryInfo(handle),
                                              calls)
        out["nvml_processes"] = timed_calls(
            lambda: lib.nvmlDeviceGetComputeRunningProcesses(handle), calls)
        out["nvml_utilization"] = timed_calls(
            lambda: lib.nvmlDeviceGetUtilizationRates(handle), calls)
    else:
        out["nvml"] = "not timed: NVML is not available here"
    return (f"probe.read {out['probe_read']['median_us']} us, tick "
            f"{out['engine_tick']['median_us']} us ({out['source']})")


def snapshot_cost(check: Check, out: dict[str, Any]) -> str:
    import torch

    memory = torch.cuda.memory
    predictor = check.runtime.predictor
    batch = check.samples(check.chosen)

    def run_ms() -> float:
        times = []
        for _ in range(3):
            started = time.perf_counter()
            predictor(batch)
            check.sync()
            times.append((time.perf_counter() - started) * 1000)
        return statistics.median(times)

    predictor(batch)
    out["batch"] = check.chosen
    out["forward_ms_history_off"] = round(run_ms(), 3)
    memory._record_memory_history(enabled="all", stacks="python", max_entries=20_000)
    try:
        out["forward_ms_history_on"] = round(run_ms(), 3)
        started = time.perf_counter()
        snapshot = memory._snapshot()
        out["snapshot_ms"] = round((time.perf_counter() - started) * 1000, 1)
        out["snapshot_segments"] = len(snapshot.get("segments", []))
        path = check.workdir / "snapshot.pickle"
        started = time.perf_counter()
        memory._dump_snapshot(str(path))  # type: ignore[no-untyped-call]
        out["dump_ms"] = round((time.perf_counter() - started) * 1000, 1)
        out["dump_bytes"] = path.stat().st_size
    finally:
        memory._record_memory_history(enabled=None)
    out["settings"] = "stacks='python', max_entries=20000"
    return (f"history adds {out['forward_ms_history_on'] - out['forward_ms_history_off']:.2f}"
            f" ms per batch; dump {out['dump_ms']} ms, {out['dump_bytes'] // 1024} KiB")


def latency_p50(check: Check, out: dict[str, Any]) -> str:
    from app.engine.batcher import MicroBatcher

    sample = check.samples(1)[0]
    for wait_ms in (0.0, 2.0):
        batcher = MicroBatcher(check.runtime.recovery, max_batch=check.chosen,
                               max_wait_s=wait_ms / 1000, name="gpu-check-latency")
        batcher.start()
        try:
            for _ in range(3):
                batcher.submit(sample, 30.0).result(30.0)
            times = []
            for _ in range(check.plan.latency_requests):
                started = time.perf_counter()
                batcher.submit(sample, 30.0).result(30.0)
                times.append((time.perf_counter() - started) * 1000)
        finally:
            batcher.stop()
        out[f"wait_{wait_ms:g}ms"] = {"requests": len(times),
                                      "p50_ms": round(statistics.median(times), 3),
                                      "p90_ms": round(percentile(times, 0.9), 3),
                                      "mean_ms": round(statistics.mean(times), 3)}
    out["wait_cost_ms"] = round(out["wait_2ms"]["p50_ms"] - out["wait_0ms"]["p50_ms"], 3)
    return (f"p50 {out['wait_0ms']['p50_ms']} ms at 0 ms wait, "
            f"{out['wait_2ms']['p50_ms']} ms at 2 ms")
