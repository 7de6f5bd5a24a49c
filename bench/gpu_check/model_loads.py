"""One model load in the multi-model step, measured and put to use.

What the engine predicted before a load (the weights file's size, or a stored profile),
what it measured after, the memory it took, and the espresso photo classified through the
model's lane as a request goes. An unload must give the weights back.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from bench.gpu_check.plan import ESPRESSO, LOAD_TOLERANCE
from bench.gpu_check.state import Check

if TYPE_CHECKING:
    import torch

    from app.engine.engine import InferenceEngine
    from app.preprocessing import Preprocessing


def espresso(check: Check, spec: Preprocessing, max_pixels: int) -> torch.Tensor:
    """The espresso photo as ``spec``'s input, made as the decode workers make it."""
    import torch

    from app.imaging.decoding import open_image
    from app.imaging.pixels import model_input

    key = (spec.resize, spec.crop)
    if key not in check.photos:
        check.photos[key] = model_input(open_image(ESPRESSO.read_bytes(), max_pixels,
                                                   spec.resize), spec)
    return torch.from_numpy(check.photos[key].copy())


async def classify_espresso(check: Check, engine: InferenceEngine, name: str
                            ) -> dict[str, Any]:
    """The espresso photo through the engine's lane for ``name``, as a request goes."""
    from app.engine.predictor import Sample

    model = engine.runtimes[name].model
    sample = Sample(espresso(check, model.preprocessing, engine.settings.max_image_pixels), 5)
    with engine.admit(60.0, name) as place:
        prediction = await engine.classify(sample, 60.0, place, name)
    label = model.labels[int(prediction.ranked.indices[0])]
    if name in check.stand_ins:  # seeded weights: any label is their answer
        return {"top1": label, "score": round(float(prediction.ranked.scores[0]), 4),
                "espresso": None, "stand_in": check.stand_ins[name]}
    if label != "espresso":
        check.fail("wrong_answer", "multi_model", f"{name} on {check.device} took the "
                   f"espresso photo for '{label}'")
    return {"top1": label, "score": round(float(prediction.ranked.scores[0]), 4),
            "espresso": label == "espresso"}


def stored_profile(engine: InferenceEngine, name: str) -> dict[str, Any] | None:
    """What the profile stored for ``name`` (this device and versions) predicts."""
    from app.models import resolve_weights
    from app.models.registry import fingerprint

    key = engine._profile_key(name, fingerprint(resolve_weights(name)))
    stored = engine.profiles.get(key)
    if stored is None:
        return None
    # The batch size a load that reuses it runs at (Calibration._reuse, app/engine/calibration.py).
    batch = min(engine.settings.batch_size or stored.chosen_batch_size, stored.points[-1][0])
    peak = stored.footprint_peak(batch)
    return {"weights_bytes": stored.weights_bytes, "batch_size": batch,
            "batch_peak_bytes": peak, "total_bytes": stored.weights_bytes + peak,
            "chosen_batch_size": stored.chosen_batch_size,
            "out_of_memory_at": stored.out_of_memory_at,
            "out_of_memory_on_load": stored.out_of_memory_on_load}


async def timed_load(check: Check, engine: InferenceEngine, name: str) -> dict[str, Any]:
    """Load ``name`` (the first one pinned, by the engine's start; the others on demand,
    as a request asks), with what was predicted before and measured after."""
    pinned = name == engine.settings.model
    guess = engine._guess(name)
    stored = stored_profile(engine, name)
    by = ("the weights file's size" if not guess.batch_peak else "the stored profile"
          if stored and guess.batch_peak == stored["batch_peak_bytes"] else "elsewhere")
    record: dict[str, Any] = {"model": name, "pinned": pinned, "predicted": {
        "by": by, "weights_bytes": guess.weights, "batch_peak_bytes": guess.batch_peak,
        "total_bytes": guess.weights + guess.batch_peak}, "stored_profile": stored}
    before = check.device_memory(engine)
    started = time.perf_counter()
    if pinned:
        await engine.start()
        if name not in engine.runtimes:
            raise RuntimeError(f"{name} did not load at start: {engine.error}")
    else:
        await engine.acquire(name, 120.0)
    record["seconds"] = round(time.perf_counter() - started, 3)
    after = check.device_memory(engine)
    record["memory_delta"] = {key: after[key] - before[key] for key in after}
    record["memory_after"] = after
    runtime = engine.runtimes[name]
    fit, footprint = runtime.memory.fit, runtime.footprint
    points = runtime.memory.points
    check.model_fits[name] = fit
    record["measured"] = {
        "weights_bytes": footprint.weights, "fixed_bytes_c": fit.fixed_bytes,
        "bytes_per_sample_k": fit.bytes_per_sample, "batch_size": runtime.guard.max_batch,
        "batch_peak_bytes": footprint.batch_peak,
        "total_bytes": footprint.weights + footprint.batch_peak,
        "peak_one_bytes": points[0][1] if points[0][0] == 1 else fit.peak(1),
        "profile_points": points, "profile_reused": runtime.reused_profile}
    record["allocated_beyond_weights_bytes"] = (record["memory_delta"]["allocated"]
                                                - footprint.weights)
    del runtime  # no reference of ours may keep the model alive past its unload
    record["engine_load_seconds"] = round(engine.outcomes[name].load_seconds, 3)
    record["classified"] = await classify_espresso(check, engine, name)
    return record


def judge_unload(check: Check, event: dict[str, Any]) -> None:
    """An unloaded (evicted, admin) model gave its weights back to the device."""
    weights, drop = event["weights_bytes"], event["allocated_drop"]
    event["drop_minus_weights_bytes"] = drop - weights
    event["gave_back_its_weights"] = (abs(drop - weights) <= LOAD_TOLERANCE
                                      and event["module_freed"])
    if not event["gave_back_its_weights"]:
        check.fail("unload_kept_memory", "multi_model",
                   f"unloading {event['model']} ({event['reason']}) gave back {drop} bytes "
                   f"of its {weights} bytes of weights; module freed: "
                   f"{event['module_freed']}")
