"""The out-of-memory steps: the engine's split-and-retry put to the test, with no server.

forced_oom caps the allocator (set_per_process_memory_fraction on a GPU, the CPU tracker's
cap dry) so a batch of 2m does not fit and m does; pressure_oom leaves the same room with a
filler tensor instead. Each batch goes through the real ``OomRecovery``; ``judge`` turns
what came out into failures (a 500, a 503 a smaller batch could have served) and warnings.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from bench.gpu_check.plan import MIN_STEP
from bench.gpu_check.runner import Skip, describe, is_sticky, type_name
from bench.gpu_check.state import Check

if TYPE_CHECKING:
    import torch

    from app.engine.predictor import Sample
    from app.memory.guard import MemoryGuard
    from app.memory.probes import Probe


def oom_limit(base_reserved: int, increases: dict[int, int]) -> tuple[int, int] | None:
    """The forced OOM's limit: (batch size m that fits, limit in bytes), or None.

    ``set_per_process_memory_fraction`` caps the allocator's *reserved* segments, so the
    limit is what is reserved after ``empty_cache`` plus the reserved increase a batch of
    m measured, plus half the step to a batch of 2m: m fits, 2m does not, whatever the
    segment rounding. A limit sized from allocated bytes falls below the cuBLAS workspace
    and the rounded weights, and then not even a batch of 1 fits.
    """
    for m in (2, 4, 8, 1):
        if m in increases and 2 * m in increases:
            step = increases[2 * m] - increases[m]
            if step >= MIN_STEP:
                return m, base_reserved + increases[m] + step // 2
    return None


R = TypeVar("R")


def recording(forward: Callable[[list[Sample]], R], seen: list[dict[str, Any]],
              classify: Callable[[BaseException], object] | None = None,
              ) -> Callable[[list[Sample]], R]:
    """``forward``, noting each exception that passes through it (which kinds an OOM takes
    on this GPU) and, where the app has a classifier, what the app takes it for."""
    def run(samples: list[Sample]) -> R:
        try:
            return forward(samples)
        except Exception as exc:
            event = {"type": type_name(exc), "message": str(exc)[:300], "batch": len(samples)}
            if classify is not None:
                with contextlib.suppress(Exception):
                    event["classified_as"] = str(getattr(classify(exc), "value", ""))
            seen.append(event)
            raise
    return run


def fresh_guard(check: Check) -> MemoryGuard:
    """A guard like the engine's, so the OOM steps' lessons do not change the engine's."""
    from app.memory.guard import MemoryGuard

    guard = check.runtime.guard
    return MemoryGuard(guard.budget, check.runtime.memory.fit,
                       max_batch=max(guard.max_batch, 64), high=guard.high_fraction,
                       low=guard.low_fraction)


def recover(check: Check, probe: Probe, batch: list[Sample]) -> dict[str, Any]:
    """One batch through the real OomRecovery, and what came out of it."""
    from app.engine import oom
    from app.engine.predictor import Prediction
    from app.errors import InsufficientMemory

    seen: list[dict[str, Any]] = []
    guard = fresh_guard(check)
    classify = getattr(oom, "classify_error", None)
    recovery = oom.OomRecovery(recording(check.runtime.predictor, seen, classify), guard,
                               probe)
    result: dict[str, Any] = {"batch": len(batch)}
    try:
        outcomes = recovery(batch)
    except Exception as exc:
        result["escaped"] = describe(exc)
        if is_sticky(exc):  # the later steps would only fail on the broken context
            check.steps.cuda_broken = check.steps.current
        outcomes = []
    result["answered"] = sum(isinstance(o, Prediction) for o in outcomes)
    result["refused_503"] = sum(isinstance(o, InsufficientMemory) for o in outcomes)
    result["other"] = [type_name(o) for o in outcomes
                       if not isinstance(o, Prediction | InsufficientMemory)]
    result["sub_batch_sizes"] = sorted({o.batch_size for o in outcomes
                                        if isinstance(o, Prediction)})
    kinds: dict[str, dict[str, Any]] = {}
    for event in seen:
        kind = kinds.setdefault(event["type"], {
            "count": 0, "first_message": event["message"], "batch_sizes": [],
            "classified_as": event.get("classified_as")})
        kind["count"] += 1
        kind["batch_sizes"].append(event["batch"])
    result["exceptions_seen"] = kinds
    counters = guard.counters
    result["guard"] = {"oom_events": counters.oom_events,
                       "oom_recoveries": counters.oom_recoveries,
                       "oom_failures": counters.oom_failures,
                       "learned_bytes_per_sample": guard.fit.bytes_per_sample}
    return result


def judge(check: Check, step: str, name: str, result: dict[str, Any], servable: bool) -> None:
    """Turn one recovery's outcome into failures and warnings."""
    if "escaped" in result:
        error = result["escaped"]
        check.fail("crash", step, f"{name}: {error['type']} escaped the OOM recovery "
                   f"(the batch would fail with 500): {error['message'][:200]}")
    if result["other"]:
        check.fail("crash", step, f"{name}: requests got {sorted(set(result['other']))}")
    if servable and result["refused_503"]:
        check.fail("oom_killed_request", step,
                   f"{name}: {result['refused_503']} of {result['batch']} requests got 503 "
                   "although a smaller batch fits")
    if not result["guard"]["oom_events"] and "escaped" not in result:
        check.warn(step, f"{name}: the limit forced no out-of-memory, so recovery did not run")


def reserved_increases(check: Check, sizes: list[int]) -> dict[int, int]:
    """Reserved bytes each batch size adds after empty_cache (the worst of two passes):
    exactly what the fraction limit caps."""
    import torch

    cuda, dev, predictor = torch.cuda, check.dev, check.runtime.predictor
    increases = {}
    for n in sizes:
        batch = check.samples(n)
        worst = 0
        for _ in range(2):
            cuda.synchronize(dev)
            cuda.empty_cache()
            base = cuda.memory_reserved(dev)
            cuda.reset_peak_memory_stats(dev)
            predictor(batch)
            cuda.synchronize(dev)
            worst = max(worst, cuda.max_memory_reserved(dev) - base)
        increases[n] = worst
    cuda.empty_cache()
    return increases


def oom_increases(check: Check) -> dict[int, int]:
    """Measured once, for every step that sizes a limit or a room by them."""
    if check.increases is None:
        check.increases = reserved_increases(check, [1, 2, 4, 8, 16])
    return check.increases


def forced_oom(check: Check, out: dict[str, Any]) -> str:
    runtime = check.runtime
    probe = runtime.probe
    if not check.cuda:
        from app.memory.probes import CpuProbe

        fit, weights = runtime.memory.fit, runtime.memory.weights_bytes
        k = fit.bytes_per_sample
        limit = weights + fit.peak(2) + k // 2
        out["limit"] = {"bytes": limit, "fits_batch": 2,
                        "method": "the CPU tracker's cap: weights + fit.peak(2) + k/2"}
        out["split"] = recover(check, CpuProbe(weights, cap=limit), check.samples(8))
        out["single"] = recover(check, CpuProbe(weights, cap=weights + k // 2),
                                check.samples(1))
        out["leak_bytes"] = "not measured: the CPU keeps no allocator cache"
        m = 2
    else:
        import torch

        dev = check.dev
        cuda = torch.cuda
        increases = oom_increases(check)
        cuda.empty_cache()
        base, total = cuda.memory_reserved(dev), cuda.mem_get_info(dev)[1]
        out.update(base_reserved_bytes=base, reserved_increases=increases, total_bytes=total)
        chosen = oom_limit(base, increases)
        if chosen is None:
            raise Skip(f"no batch size in {sorted(increases)} grows reserved memory in steps "
                       f"a limit could fall between: {increases}")
        m, limit = chosen
        out["limit"] = {"bytes": limit, "fraction": limit / total, "fits_batch": m,
                        "method": "memory_reserved() after empty_cache + the measured "
                        "reserved increase of m + half the step to 2m"}
        previous = check.engine.settings.memory_fraction
        allocated_before = cuda.memory_allocated(dev)
        try:
            cuda.set_per_process_memory_fraction(limit / total, dev)
            out["split"] = recover(check, probe, check.samples(8 * m))
            if increases[1] >= MIN_STEP:
                single = base + increases[1] // 2
                cuda.set_per_process_memory_fraction(single / total, dev)
                out["single"] = recover(check, probe, check.samples(1))
                out["single"]["limit_bytes"] = single
            else:
                out["single"] = {"skipped": "a batch of 1 reserves no new segment after "
                                 "empty_cache, so no fraction limit can refuse it"}
        finally:
            cuda.set_per_process_memory_fraction(previous, dev)
            cuda.empty_cache()
        gc.collect()
        cuda.empty_cache()
        out["leak_bytes"] = cuda.memory_allocated(dev) - allocated_before
        if out["leak_bytes"]:
            check.warn("forced_oom", f"{out['leak_bytes']} bytes stayed allocated after "
                       "the recoveries")
    judge(check, "forced_oom", "split", out["split"], servable=True)
    single_result = out["single"]
    if "refused_503" in single_result and single_result["refused_503"] != 1:
        check.warn("forced_oom", "a single image that cannot fit was not refused with 503")
    split = out["split"]
    return (f"limit fits {m}: {split['answered']}/{split['batch']} answered in batches of "
            f"{split['sub_batch_sizes']}, {split['guard']['oom_events']} OOMs, kinds "
            f"{sorted(split['exceptions_seen'])}")


def pressure_oom(check: Check, out: dict[str, Any]) -> str:
    import torch

    dev = check.dev
    cuda = torch.cuda
    probe = check.runtime.probe
    increases = oom_increases(check)
    chosen = oom_limit(0, increases)
    if chosen is None:
        raise Skip(f"no reserved step to size the room by: {increases}")
    m, room = chosen
    previous = check.engine.settings.memory_fraction
    fillers: list[torch.Tensor | None] = []
    try:
        cuda.set_per_process_memory_fraction(1.0, dev)  # the filler alone passes 0.7
        cuda.empty_cache()
        fillers.append(check.filler(cuda.mem_get_info(dev)[0] - room))
        free = cuda.mem_get_info(dev)[0]
        out["room"] = {"intended_bytes": room, "free_bytes": free, "fits_batch": m,
                       "filler_bytes": fillers[0].numel() if fillers[0] is not None else 0}
        out["split"] = recover(check, probe, check.samples(8 * m))
        judge(check, "pressure_oom", "split", out["split"], servable=free >= increases[m])
        if increases[1] >= MIN_STEP:
            cuda.empty_cache()
            fillers.append(check.filler(cuda.mem_get_info(dev)[0] - increases[1] // 2))
            out["below_one_image"] = recover(check, probe, check.samples(1))
            out["below_one_image"]["free_bytes"] = cuda.mem_get_info(dev)[0]
            judge(check, "pressure_oom", "below one image", out["below_one_image"],
                  servable=False)
    finally:
        fillers.clear()
        cuda.empty_cache()
        cuda.set_per_process_memory_fraction(previous, dev)
    kinds = sorted({*out["split"]["exceptions_seen"],
                    *out.get("below_one_image", {}).get("exceptions_seen", {})})
    split = out["split"]
    return (f"room for {m}: {split['answered']}/{split['batch']} answered, "
            f"exception kinds {kinds}")
