"""The prepared check of the real CUDA paths, for a machine with an NVIDIA GPU.

    python -m bench.gpu_check [--device cuda] [--seconds 5] [--out docs/gpu-check.json]

Runs, in one go: memory profiling at warmup (c, k, weights, overhead), the
budget, throughput at the chosen batch size, a forced out-of-memory (a small
``set_per_process_memory_fraction`` on CUDA, the CPU memory cap elsewhere)
with split-and-retry recovery, a single image that cannot fit (503), and a
leak check (allocated memory back at its baseline). Prints a table. On a
machine without a GPU it runs the same steps on the CPU, which keeps it honest
in CI.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from app.config import load_settings
from app.engine.engine import InferenceEngine, Runtime
from app.engine.oom import OomRecovery
from app.engine.predictor import Prediction
from app.errors import InsufficientMemory
from app.memory.probes import CpuProbe, CudaProbe, Probe
from app.units import human_bytes


def _squeeze(runtime: Runtime, limit_bytes: int) -> Probe:
    """A probe whose device holds only ``limit_bytes`` (weights included)."""
    probe = runtime.probe
    if isinstance(probe, CudaProbe):
        total = torch.cuda.get_device_properties(probe.device).total_memory
        probe.empty_cache()
        probe.set_backstop(limit_bytes / total)
        return probe
    return CpuProbe(probe.weights, cap=limit_bytes)


def _release(runtime: Runtime) -> None:
    runtime.probe.set_backstop(1.0)
    runtime.probe.empty_cache()


def run(device: str, seconds: float, max_batch: int) -> dict[str, object]:
    settings = load_settings(device=device, max_batch_size=max_batch, cache=False)
    engine = InferenceEngine(settings)
    started = time.perf_counter()
    runtime = engine.warm_up(engine.load())
    warm_s = time.perf_counter() - started
    predictor, guard, memory, fit = (runtime.predictor, runtime.guard, runtime.memory,
                                     runtime.memory.fit)
    chosen = engine.batcher.max_batch
    report: dict[str, object] = {
        "device": str(engine.device),
        "device_name": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda"
        else "cpu",
        "warmup_s": round(warm_s, 2),
        "warmup": [(t.batch_size, round(t.seconds * 1000, 2)) for t in runtime.warmup.timings],
        "chosen_batch": chosen,
        "weights_bytes": memory.weights_bytes,
        "overhead_bytes": memory.overhead_bytes,
        "fixed_bytes_c": fit.fixed_bytes,
        "bytes_per_sample_k": fit.bytes_per_sample,
        "profile_points": memory.points,
        "budget_lines": guard.budget.lines(),
        "budget_bytes": guard.budget_bytes,
        "max_batch_now": guard.max_batch_now(runtime.probe.in_use()),
    }

    batch = predictor.random_batch(chosen)
    predictor(batch)
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        predictor(batch)
        done += chosen
    report["throughput_img_s"] = round(done / (time.perf_counter() - t0), 1)

    baseline = runtime.probe.read().allocated
    fits_two = memory.weights_bytes + fit.peak(2) + fit.bytes_per_sample // 2
    probe = _squeeze(runtime, fits_two)
    recovery = OomRecovery(predictor, guard, probe)
    big = max(8, chosen)
    outcomes = recovery(predictor.random_batch(big))
    report["forced_oom"] = {
        "limit_bytes": fits_two, "batch": big,
        "answered": sum(isinstance(o, Prediction) for o in outcomes),
        "sub_batch_sizes": sorted({o.batch_size for o in outcomes if isinstance(o, Prediction)}),
        "oom_events": guard.counters.oom_events, "recoveries": guard.counters.oom_recoveries,
    }
    _release(runtime)
    probe = _squeeze(runtime, memory.weights_bytes + fit.bytes_per_sample // 2)
    single = OomRecovery(predictor, guard, probe)(predictor.random_batch(1))
    report["single_too_big_gives_503"] = isinstance(single[0], InsufficientMemory)
    _release(runtime)
    del outcomes, single
    leftover = runtime.probe.read().allocated - baseline
    report["leak_bytes_after_recovery"] = leftover
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = run(args.device, args.seconds, args.max_batch_size)
    for key, value in report.items():
        if key == "budget_lines":
            print("budget:")
            for line in value:  # type: ignore[attr-defined]
                print(f"    {line}")
        elif key.endswith("_bytes") and isinstance(value, int):
            print(f"{key:<28} {human_bytes(value)} ({value})")
        else:
            print(f"{key:<28} {value}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    forced = report["forced_oom"]
    ok = (isinstance(forced, dict) and forced["answered"] == forced["batch"]
          and report["single_too_big_gives_503"] and report["leak_bytes_after_recovery"] == 0)
    print("GPU CHECK PASSED" if ok else "GPU CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
