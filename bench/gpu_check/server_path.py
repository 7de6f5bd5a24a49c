"""The server path step: a started engine with a small budget, as the appliance runs it.

Its batcher, guard and probe under load, a forced out-of-memory (a fraction limit on a
GPU; dry, a CPU cap that holds from the first batch), the load dropped, and whether the
guard comes back to ok. A request that gets 503 although one image fits is a failure.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from bench.gpu_check.oom import oom_increases, oom_limit
from bench.gpu_check.plan import MiB
from bench.gpu_check.runner import Skip, type_name
from bench.gpu_check.state import Check

if TYPE_CHECKING:
    from app.engine.engine import InferenceEngine
    from app.engine.oom import Outcome

T = TypeVar("T")


def server_path(check: Check, out: dict[str, Any]) -> str:
    from app.engine.engine import InferenceEngine

    memory = check.runtime.memory
    fit, weights, k = memory.fit, memory.weights_bytes, memory.fit.bytes_per_sample
    size = check.plan.server_batch
    overrides: dict[str, Any] = {"max_batch_size": size,
                                 "target_latency_ms": check.plan.target_latency_ms}
    if check.cuda:
        overrides["memory_budget"] = 2 * fit.peak(8) + 64 * MiB
    else:
        # System memory is the device, and other programs' growth comes off the budget:
        # a small one would drop to 0 on a busy machine. The cap plays the small GPU:
        # from the first batch on, a batch of 2 does not fit and one image does.
        overrides["memory_budget"] = 4 * 1024**3
        overrides["cpu_memory_cap"] = weights + fit.peak(1) + k // 2
        # Fixed, so that a busy machine's warmup timings cannot settle on batches of 1.
        overrides["batch_size"] = size
    out["settings"] = {key: int(value) for key, value in overrides.items()}
    engine = InferenceEngine(check.settings(**overrides))
    try:
        return serve(check, engine, out, overrides)
    finally:
        engine.stop()
        del engine  # the engine and its batcher refer to each other: collect them
        gc.collect()
        if check.cuda_ready:
            import torch

            torch.cuda.empty_cache()


def serve(check: Check, engine: InferenceEngine, out: dict[str, Any],
          overrides: dict[str, Any]) -> str:
    """The server path on a started engine: what its batcher, guard and probe do."""
    from app.engine.predictor import Prediction
    from app.units import human_bytes

    size = overrides["max_batch_size"]
    phases: dict[str, Any] = {}
    out["phases"] = phases
    asyncio.run(engine.start())  # the real start: load and warmup on the device thread
    if not engine.ready:
        check.fail("crash", "server_path", f"the engine did not start: {engine.error}")
        raise RuntimeError(f"the engine did not start: {engine.error}")
    runtime = engine.require_runtime()
    guard, probe = runtime.guard, runtime.probe
    out.update(budget_bytes=guard.budget_bytes, high_watermark_bytes=guard.high_bytes,
               low_watermark_bytes=guard.low_bytes, chosen_batch=engine.batcher.max_batch,
               profile_reused=runtime.reused_profile)  # False: its own profile folder

    def on_device(fn: Callable[[], T]) -> T:
        return engine.batcher.call(fn).result(timeout=60)

    def burst(n: int) -> dict[str, Any]:
        sizes_before = Counter(engine.batcher.stats.sizes)
        oom_before = guard.counters.oom_events
        counts: Counter[str] = Counter()
        first: dict[str, str] = {}
        futures: list[Future[Outcome]] = []
        # The device thread waits while the burst queues, so the first batch is full
        # whatever the machine's speed.
        gate = threading.Event()
        held = engine.batcher.call(lambda: gate.wait(30))
        for sample in check.samples(n):
            try:
                futures.append(engine.batcher.submit(sample, 60.0))
            except Exception as exc:
                counts[type_name(exc)] += 1
                first.setdefault(type_name(exc), str(exc)[:200])
        gate.set()
        held.result(timeout=60)
        for future in futures:
            try:
                outcome = future.result(timeout=90)
            except Exception as exc:
                counts[type_name(exc)] += 1
                first.setdefault(type_name(exc), str(exc)[:200])
                continue
            answered = isinstance(outcome, Prediction)
            counts["answered" if answered else type_name(outcome)] += 1
        if getattr(engine, "device_lost", False):
            check.steps.cuda_broken = check.steps.current
        batches = Counter(engine.batcher.stats.sizes) - sizes_before
        return {"requests": n, "outcomes": dict(counts), "first_messages": first,
                "batch_sizes": dict(sorted(batches.items())),
                "oom_events": guard.counters.oom_events - oom_before,
                "state_after": str(guard.state), "usage_after_bytes": guard.usage}

    def judge_phase(phase: str, result: dict[str, Any]) -> None:
        for kind, count in result["outcomes"].items():
            if kind == "answered":
                continue
            if kind.endswith("InsufficientMemory"):
                check.fail("oom_killed_request", "server_path",
                           f"{phase}: {count} request(s) got 503 insufficient_memory "
                           "although one image fits")
            elif kind.endswith(("Overloaded", "DeadlineExceeded")):
                check.warn("server_path", f"{phase}: {count} request(s) refused as {kind}")
            else:
                check.fail("crash", "server_path", f"{phase}: {count} request(s) failed "
                           f"with {kind}: {result['first_messages'].get(kind, '')}")

    baseline = on_device(lambda: probe.read().allocated)
    on_device(probe.reset_peak)
    phases["load"] = burst(4 * size)
    judge_phase("load", phases["load"])
    if check.cuda_ready:
        peak = on_device(lambda: probe.read().peak_allocated) - baseline
        phases["load"]["peak_beyond_baseline_bytes"] = peak
        if peak > guard.budget_bytes:
            check.fail("peak_over_budget", "server_path",
                       f"a batch peaked {human_bytes(peak)} beyond what was allocated "
                       f"after warmup; the budget is {human_bytes(guard.budget_bytes)}")
    if check.cuda_ready:
        import torch

        cuda, dev = torch.cuda, check.dev
        on_device(cuda.empty_cache)
        base = on_device(lambda: cuda.memory_reserved(dev))
        total = cuda.mem_get_info(dev)[1]
        chosen = oom_limit(base, oom_increases(check))
        if chosen is None:
            raise Skip("no reserved step to set a limit between (see forced_oom)")
        m, limit = chosen
        previous = engine.settings.memory_fraction
        def restore() -> None:
            cuda.set_per_process_memory_fraction(previous, dev)
            cuda.empty_cache()

        on_device(lambda: cuda.set_per_process_memory_fraction(limit / total, dev))
        try:
            phases["forced_oom"] = burst(8 * m)
        finally:
            on_device(restore)
        phases["forced_oom"]["limit"] = {"bytes": limit, "fits_batch": m}
        judge_phase("forced_oom", phases["forced_oom"])
        forced = phases["forced_oom"]
    else:
        # The cap holds from the first batch, so the load above was the forced OOM (and
        # what the guard learned from it keeps later batches to what fits).
        phases["forced_oom"] = {"same_as": "load", "limit": {
            "cpu_memory_cap": overrides["cpu_memory_cap"], "fits_batch": 1}}
        forced = phases["load"]
    if not forced["oom_events"]:
        check.warn("server_path", "the forced OOM phase ran out of memory nowhere")
    time.sleep(0.2)
    trail = []
    for _ in range(2):
        on_device(engine.tick)
        trail.append({"after": "tick", "state": str(guard.state), "usage": guard.usage})
    for _ in range(3):
        judge_phase("load_dropped", burst(1))
        trail.append({"after": "batch of 1", "state": str(guard.state),
                      "usage": guard.usage})
        on_device(engine.tick)
        trail.append({"after": "tick", "state": str(guard.state), "usage": guard.usage})
    phases["load_dropped"] = trail
    out["final_state"] = str(guard.state)
    out["back_to_ok"] = str(guard.state) == "ok"
    out["counters"] = {key: getattr(guard.counters, key) for key in (
        "oom_events", "oom_recoveries", "oom_failures", "state_changes",
        "cache_empties")}
    if not out["back_to_ok"]:
        check.warn("server_path", f"the guard stayed '{guard.state}' after the load "
                   f"dropped (usage {human_bytes(guard.usage)}, low watermark "
                   f"{human_bytes(guard.low_bytes)}): issue 13 item 1")
    return (f"budget {human_bytes(out['budget_bytes'])}; forced OOM: {forced['outcomes']}, "
            f"{forced['oom_events']} OOMs; back to ok: {out['back_to_ok']}")
