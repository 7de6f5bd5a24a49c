"""The memory steps: the model loaded and warmed as the engine does it, then measured.

load, first_forward and warmup bring the engine up (their failure means the appliance
would not start); empty_cache, batch_peaks and final read what the allocator holds, and
whether ``fit.peak(n)`` is an upper bound of what a batch of n measures.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bench.gpu_check.plan import MiB
from bench.gpu_check.state import Check

if TYPE_CHECKING:
    from app.engine.predictor import Predictor, Sample


def load(check: Check, out: dict[str, Any]) -> str:
    from app.engine.engine import InferenceEngine, weights_bytes
    from app.units import human_bytes

    settings = check.settings(max_batch_size=check.plan.max_batch,
                              target_latency_ms=check.plan.target_latency_ms)
    check.found_engine = InferenceEngine(settings)
    started = time.perf_counter()
    model = check.found_model = check.engine.load()
    check.sync()
    weights = weights_bytes(model)
    out.update(model=model.name, device=str(model.device),
               weights_file=str(model.weights_file), weights_bytes=weights,
               seconds=round(time.perf_counter() - started, 3))
    check.stage("load", out)
    return f"{model.name} on {model.device}, weights {human_bytes(weights)}"


def first_forward(check: Check, out: dict[str, Any]) -> str:
    from app.engine.predictor import Predictor

    predictor = Predictor(check.model, keep_all=False)
    batch = check.samples(1)
    times = []
    for _ in range(2):
        started = time.perf_counter()
        predictor(batch)
        check.sync()
        times.append(time.perf_counter() - started)
    out.update(first_ms=round(times[0] * 1000, 2), second_ms=round(times[1] * 1000, 2))
    check.stage("first_forward", out)
    return f"first {out['first_ms']} ms (kernels, cuDNN), then {out['second_ms']} ms"


def warmup(check: Check, out: dict[str, Any]) -> str:
    from app.units import human_bytes

    started = time.perf_counter()
    runtime = check.engine.warm_up(check.model)
    check.sync()
    out["seconds"] = round(time.perf_counter() - started, 2)
    check.found_runtime = runtime
    profile, memory, guard, probe = runtime.warmup, runtime.memory, runtime.guard, runtime.probe
    timings = [{"batch": t.batch_size, "ms": round(t.seconds * 1000, 3),
                "images_per_s": round(t.images_per_second, 1)}
               for t in getattr(profile, "timings", [])]
    check.tried = [t["batch"] for t in timings] or [1]
    check.chosen = check.engine.batcher.max_batch
    fit = memory.fit
    out.update(timings=timings, chosen_batch=check.chosen,
               warmup_choice=getattr(profile, "chosen_batch_size", None),
               out_of_memory_at=getattr(profile, "out_of_memory_at", None),
               workspaces_bytes=getattr(guard.budget, "workspaces", None),
               weights_bytes=memory.weights_bytes, overhead_bytes=memory.overhead_bytes,
               others_at_start_bytes=memory.others_at_start, fixed_bytes_c=fit.fixed_bytes,
               bytes_per_sample_k=fit.bytes_per_sample, profile_points=memory.points,
               fit_upper_bound_at_profile_points=all(fit.peak(n) >= p
                                                     for n, p in memory.points),
               budget_bytes=guard.budget_bytes, budget_lines=guard.budget.lines(),
               high_watermark_bytes=guard.high_bytes, low_watermark_bytes=guard.low_bytes,
               max_batch_now=guard.max_batch_now(probe.in_use()))
    reading = probe.read()
    out["probe"] = {"type": type(probe).__name__, "source": reading.source,
                    "process_used_bytes": probe.process_used(), "others_bytes": reading.others,
                    "overhead_bytes": reading.overhead}
    out["flags_after_warmup"] = check.flags()
    if check.cuda_ready:
        import torch

        allocated = torch.cuda.memory_allocated(check.dev)
        out["allocated_after_warmup_bytes"] = allocated
        # Beyond the weights: what stays allocated between batches (cuBLAS workspace).
        out["persistent_beyond_weights_bytes"] = allocated - memory.weights_bytes
    check.stage("warmup", out)
    return (f"batch {check.chosen} of {check.tried[0]}..{check.tried[-1]}; "
            f"k {human_bytes(fit.bytes_per_sample)}, c {human_bytes(fit.fixed_bytes)}, "
            f"budget {human_bytes(guard.budget_bytes)}")


def empty_cache(check: Check, out: dict[str, Any]) -> str:
    probe = check.runtime.probe
    before = probe.read().reserved
    probe.empty_cache()
    after = probe.read().reserved
    out.update(reserved_before_bytes=before, reserved_after_bytes=after)
    check.stage("after_empty_cache", out)
    return f"reserved {before // MiB} -> {after // MiB} MiB"


def peak_once(check: Check, predictor: Predictor, batch: list[Sample]) -> dict[str, Any]:
    """One pass from an emptied cache: peaks above the level before, and NVML's growth
    (new segments plus whatever cuDNN/cuBLAS take outside the allocator)."""
    import torch

    cuda, dev = torch.cuda, check.dev
    cuda.synchronize(dev)
    cuda.empty_cache()
    device_before = check.nvml_used()
    free_before = cuda.mem_get_info(dev)[0]
    allocated, reserved = cuda.memory_allocated(dev), cuda.memory_reserved(dev)
    cuda.reset_peak_memory_stats(dev)
    started = time.perf_counter()
    predictor(batch)
    cuda.synchronize(dev)
    seconds = time.perf_counter() - started
    device_after = check.nvml_used()
    return {"peak_allocated": cuda.max_memory_allocated(dev) - allocated,
            "peak_reserved": cuda.max_memory_reserved(dev) - reserved,
            "nvml_delta": None if device_before is None or device_after is None
            else device_after - device_before,
            "cuda_used_delta": free_before - cuda.mem_get_info(dev)[0],
            "ms": round(seconds * 1000, 3)}


def in_fresh_thread(run: Callable[[], None]) -> None:
    """``run()`` in a thread of its own, its exception raised here."""
    failed: list[BaseException] = []

    def target() -> None:
        try:
            run()
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=target, name="gpu-check-sweep", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def batch_peaks(check: Check, out: dict[str, Any]) -> str:
    runtime = check.runtime
    fit, predictor, guard = runtime.memory.fit, runtime.predictor, runtime.guard
    largest = max(check.tried)
    odd = (size for size in check.plan.odd_sizes if size <= largest)
    sizes = sorted({*check.tried, check.chosen, *odd})
    out["sizes"] = sizes
    inputs = {n: check.samples(n) for n in sizes}
    rows: list[dict[str, Any]] = []
    out["rows"] = rows
    if check.cuda:
        import torch

        cudnn = torch.backends.cudnn
        engine_setting = cudnn.benchmark
        out["engine_cudnn_benchmark"] = engine_setting
        # cuDNN's plan cache is per thread and its key omits `benchmark`: a sweep in the
        # thread that ran these shapes before would reuse those plans and measure nothing
        # new. Each sweep runs in a fresh thread, benchmark on first.
        out["sweep_order"] = ["cudnn_benchmark on", "cudnn_benchmark off"]
        out["sweep_threads"] = "each sweep in a fresh thread (cuDNN's plan cache is per thread)"

        def sweep(benchmark: bool) -> None:
            cudnn.benchmark = benchmark
            for n in sizes:
                first = peak_once(check, predictor, inputs[n])
                steady = peak_once(check, predictor, inputs[n])
                rows.append({"batch": n, "cudnn_benchmark": benchmark,
                             "fit_peak": fit.peak(n), "first": first, "steady": steady})

        try:
            for benchmark in (True, False):
                in_fresh_thread(functools.partial(sweep, benchmark))
        finally:
            cudnn.benchmark = engine_setting
            torch.cuda.empty_cache()
    else:
        out["cudnn_benchmark"] = "not applicable on the CPU: one pass per size"
        out["nvml_delta"] = "needs a GPU"
        for n in sizes:
            peak = runtime.probe.measure_peak(functools.partial(predictor, inputs[n]))
            rows.append({"batch": n, "fit_peak": fit.peak(n), "steady": {
                "peak_allocated": peak}})
    # The engine runs with its own cudnn.benchmark setting: only those rows bind the fit;
    # the others show what the opposite setting would cost.
    serving = out.get("engine_cudnn_benchmark")
    under, other_setting = [], []
    for row in rows:
        peak = max(row[p]["peak_allocated"] for p in ("first", "steady") if p in row)
        row["fit_upper_bound"] = fit.peak(row["batch"]) >= peak
        if row.get("cudnn_benchmark", serving) != serving:
            other_setting.append({"batch": row["batch"],
                                  "over_fit_bytes": peak - fit.peak(row["batch"])})
            continue
        if not row["fit_upper_bound"]:
            under.append({"batch": row["batch"], "by_bytes": peak - fit.peak(row["batch"])})
        if row["batch"] == check.chosen and peak > guard.budget_bytes:
            check.fail("peak_over_budget", "batch_peaks",
                       f"batch {check.chosen} peaked at {peak} bytes, over the budget of "
                       f"{guard.budget_bytes}")
    out["fit_under_estimates"] = under
    if other_setting:
        out["other_benchmark_setting_vs_fit"] = other_setting
    if under:
        check.warn("batch_peaks", f"fit.peak(n) under-estimates the measured peak at "
                   f"{len(under)} size(s), worst by "
                   f"{max(u['by_bytes'] for u in under) // MiB} MiB: "
                   f"{[u['batch'] for u in under][:8]}")
    bound = len(rows) - len(other_setting)
    return (f"{len(sizes)} sizes {sizes[0]}..{sizes[-1]}, fit an upper bound at "
            f"{bound - len(under)}/{bound}")


def final(check: Check, out: dict[str, Any]) -> str:
    check.stage("end", out)
    if check.cuda_ready and not check.steps.cuda_broken:
        import torch

        stats = torch.cuda.memory_stats(check.dev)
        out.update(num_ooms=stats.get("num_ooms"), num_alloc_retries=stats.get(
            "num_alloc_retries"))
    out["elapsed_s"] = round(time.monotonic() - check.started, 1)
    return f"{out['elapsed_s']} s in all"
