"""Out of memory while a model loads: the multi-model step's last phase.

With only a room left (a filler tensor on a GPU; dry, ``ShortDevice``), a request for
Lite2 runs out of memory in its weights copy or its warmup. The engine must answer 503 or
load it after one more eviction, leave nothing half-loaded behind, and mark the profile.
"""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING, Any

from bench.gpu_check.model_loads import classify_espresso, stored_profile
from bench.gpu_check.model_watch import ModelWatch, ShortDevice
from bench.gpu_check.plan import LITE, LOAD_TOLERANCE
from bench.gpu_check.runner import type_name
from bench.gpu_check.state import Check

if TYPE_CHECKING:
    import torch

    from app.engine.engine import InferenceEngine


def load_oom_rooms(weights: int, peak_one: int) -> dict[str, int]:
    """The room a filler leaves the model an out-of-memory-on-load attempt asks for: its
    weights fit but a pass of one image does not (the out-of-memory comes in warmup or the
    profile's single pass, which marks the profile); its weights do not fit (it comes while
    copying them)."""
    return {"batch_does_not_fit": weights + peak_one // 2, "weights_do_not_fit": weights // 2}


async def oom_on_load(check: Check, engine: InferenceEngine, watch: ModelWatch,
                      attempt: dict[str, Any]) -> None:
    """Lite0 pinned and Lite1 (evictable) loaded; then, with only ``room`` left for it,
    a request for Lite2: its load runs out of memory for real (the dry mode: its
    stand-in). Whatever comes of it, what was allocated before is back (within the
    tolerance) but for the weights of the models that changed."""
    from app.errors import InsufficientMemory

    await engine.start()
    await engine.acquire(LITE[1], 120.0)
    attempt["loaded_before"] = sorted(engine.runtimes)
    attempt["stored_profile"] = stored_profile(engine, LITE[2])
    weights_before = {n: int(r.memory.weights_bytes) for n, r in engine.runtimes.items()}
    room = attempt["room_bytes"]
    fillers: list[torch.Tensor | None] = []  # released in the finally below, whatever happens
    if check.cuda_ready:
        import torch

        cuda, dev = torch.cuda, check.dev
        cuda.synchronize(dev)
        cuda.empty_cache()
        fraction = engine.settings.memory_fraction

        def headroom() -> int:
            free, total = cuda.mem_get_info(dev)
            return int(min(free, int(fraction * total) - cuda.memory_reserved(dev)))

        size = headroom() - room
        attempt["filler"] = {"intended_bytes": size, "memory_fraction": fraction}
        fillers.append(check.filler(size))
        if fillers[0] is None:
            raise RuntimeError(f"could not allocate a filler of {size} bytes")
        attempt["filler"]["bytes"] = int(fillers[0].numel())
        attempt["room_left_bytes"] = headroom()
    else:
        watch.short = ShortDevice(LITE[2], room, check.model_fits[LITE[2]])
    at, modules_at = len(watch.events), len(watch.modules)
    try:
        # Garbage first: an earlier out-of-memory's traceback can hold activations until a
        # collection, which would then fall inside the attempt and look like memory given
        # back (found by the run on the CUDA stand-in).
        gc.collect()
        before = check.device_memory(engine)
        started = time.perf_counter()
        try:
            await engine.acquire(LITE[2], 120.0)
            attempt["outcome"] = "loaded"
        except InsufficientMemory as exc:
            attempt["outcome"] = f"{exc.status} {exc.code}"
            attempt["message"] = exc.message[:400]
        except Exception as exc:
            attempt["outcome"] = type_name(exc)
            attempt["message"] = str(exc)[:400]
        attempt["seconds"] = round(time.perf_counter() - started, 3)
        # As the engine left it (no collection of ours first), then after one; the
        # filler still held, as it was in ``before``.
        after = check.device_memory(engine)
        weights_after = {n: int(r.memory.weights_bytes) for n, r in engine.runtimes.items()}
        installed = {id(r.model.module) for r in engine.runtimes.values()}
        loaded = watch.modules[modules_at:]
        alive = [n for n, ref in loaded if ref() is not None and id(ref()) not in installed]
        gc.collect()
        after_gc = check.device_memory(engine)
        alive_gc = [n for n, ref in loaded
                    if ref() is not None and id(ref()) not in installed]
    finally:
        fillers.clear()
        if check.cuda_ready:
            import torch

            torch.cuda.empty_cache()
        if watch.short is not None:
            watch.short.active = False
            attempt["stand_in_raised_in"] = watch.short.raised
    expected = sum(weights_after.values()) - sum(weights_before.values())
    attempt.update(
        loaded_after=sorted(weights_after), memory_before=before, memory_after=after,
        expected_allocated_change_bytes=expected,
        leak_bytes=after["allocated"] - before["allocated"] - expected,
        leak_bytes_after_gc=after_gc["allocated"] - before["allocated"] - expected,
        half_loaded_alive=alive, half_loaded_alive_after_gc=alive_gc,
        events=watch.events[at:],
        out_of_memory_in=[e["event"] for e in watch.events[at:]
                          if e.get("kind") == "out_of_memory"],
        evicted=[e["model"] for e in watch.since(at, "unload")
                 if e["reason"] == "evicted"],
        profile_marked=any(p["out_of_memory_on_load"] for p in watch.since(at, "profile_put")
                           if p["model"] == LITE[2]),
        # The profile a later load could reuse, as stored before this attempt: none when
        # every earlier load of the model measured batch size 1 only (a load made while
        # serving stores its profile once the background measurement completes).
        profile_reusable=_reusable_profile(watch, at))
    if check.cuda_ready:
        attempt["reserved_change_bytes"] = after["reserved"] - before["reserved"]
    if LITE[2] in engine.runtimes:
        attempt["classified"] = await classify_espresso(check, engine, LITE[2])


def judge_oom_on_load(check: Check, attempt: dict[str, Any]) -> None:
    """503 insufficient_memory or a load after one more eviction; nothing left behind;
    the profile marked when the out-of-memory came in warmup."""
    kind, outcome = attempt["kind"], attempt.get("outcome")
    if outcome is None:
        return  # the attempt itself failed: the step's error says why
    if outcome not in ("loaded", "503 insufficient_memory"):
        check.fail("crash", "multi_model", f"{kind}: the request for {LITE[2]} got "
                   f"{outcome}: {attempt.get('message', '')[:200]}")
    ooms = attempt["out_of_memory_in"]
    if not ooms:
        check.warn("multi_model", f"{kind}: the load ran out of memory nowhere ({outcome}, "
                   f"{attempt.get('room_left_bytes', attempt['room_bytes'])} bytes left)")
    if outcome == "loaded" and ooms and not attempt["evicted"]:
        check.fail("crash", "multi_model", f"{kind}: {LITE[2]} loaded after running out "
                   "of memory without evicting anything")
    leak, late = attempt["leak_bytes_after_gc"], attempt["leak_bytes"]
    if leak > LOAD_TOLERANCE or attempt["half_loaded_alive_after_gc"]:
        check.fail("load_oom_leaked", "multi_model", f"{kind}: after the failed load "
                   f"{leak} bytes more than the loaded models' weights stayed allocated; "
                   f"half-loaded modules alive: {attempt['half_loaded_alive_after_gc']}")
    elif leak < -LOAD_TOLERANCE:  # nothing stayed: the evicted model held more than weights
        check.warn("multi_model", f"{kind}: {-leak} bytes more than the weights of the "
                   "models that changed were given back (what an evicted model held beside "
                   "its weights, such as its last batch's outputs)")
    elif late > LOAD_TOLERANCE or attempt["half_loaded_alive"]:
        check.warn("multi_model", f"{kind}: {late} bytes (modules "
                   f"{attempt['half_loaded_alive']}) stayed allocated until a garbage "
                   "collection after the request was answered")
    if "warm_up" in ooms and not attempt["profile_marked"] and attempt["profile_reusable"]:
        check.fail("profile_not_marked", "multi_model", f"{kind}: {LITE[2]} ran out of "
                   "memory in warmup and its profile was not marked out_of_memory_on_load")
    elif ooms and not attempt["profile_marked"]:
        check.warn("multi_model", f"{kind}: {LITE[2]} ran out of memory only while "
                   "copying its weights, and the engine marks the profile only for an "
                   "out-of-memory in warmup: out_of_memory_on_load stayed false")
    squeezed = [p for p in attempt["events"] if p["event"] == "profile_put"
                and not p["out_of_memory_on_load"] and p["out_of_memory_at"] is not None]
    if squeezed:
        check.warn("multi_model", f"{kind}: the retry measured {LITE[2]} again while "
                   f"memory was still short and stored that profile (batch "
                   f"{squeezed[-1]['chosen_batch_size']}, out of memory at "
                   f"{squeezed[-1]['out_of_memory_at']}): later loads reuse it after the "
                   "memory is back")


def _reusable_profile(watch: ModelWatch, before: int) -> bool:
    """Whether the last profile stored for the model before event ``before`` could be
    reused by its next load (stored, and not marked out_of_memory_on_load)."""
    puts = [event for event in watch.events[:before]
            if event["event"] == "profile_put" and event["model"] == LITE[2]]
    return bool(puts) and not puts[-1]["out_of_memory_on_load"]
