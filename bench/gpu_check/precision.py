"""The precision step: which ``precision`` and ``channels_last`` the GPU should get.

In fp32 NCHW torch runs EfficientNet-Lite's depthwise convolutions with its own kernel,
not cuDNN's (it sends them to cuDNN only in fp16 or channels_last), so fp32 may
understate a modern GPU. Each setting (fp32, bf16, fp16; channels_last off and on) runs
on a copy of the warmed-up model, converted as the engine converts it
(``app.models.precision``), at the batch size warmup chose: images/s, memory per image
(the allocator's peak of a batch of n against a batch of 1, on a GPU), and on the
shipped test photos the largest score difference and top-1 agreement against fp32. The
recommendation is the fastest setting that agrees: score differences at most
``SCORE_TOLERANCE``, and the same top-1 wherever fp32's margin between its two best
labels exceeds twice the difference (the cat photo's two best are 0.008 apart).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import TYPE_CHECKING, Any

from bench.gpu_check.plan import ESPRESSO, ROOT
from bench.gpu_check.state import Check

if TYPE_CHECKING:
    import numpy as np

    from app.engine.predictor import Predictor, Sample
    from app.models import LoadedModel

PHOTOS = (ESPRESSO, ROOT / "tests" / "data" / "chelsea.jpg")
SETTINGS = (("fp32", False), ("fp32", True), ("bf16", False), ("bf16", True),
            ("fp16", False), ("fp16", True))
SCORE_TOLERANCE = 0.02


def photo_samples(check: Check, model: LoadedModel) -> list[Sample]:
    import torch

    from app.engine.predictor import Sample
    from app.imaging.decoding import open_image
    from app.imaging.pixels import model_input

    spec = model.preprocessing
    return [Sample(torch.from_numpy(model_input(open_image(path.read_bytes(), 10**8,
                                                           spec.resize), spec).copy()),
                   model.num_classes) for path in PHOTOS]


def all_scores(predictor: Predictor, samples: list[Sample], classes: int) -> np.ndarray:
    import numpy as np

    out = np.zeros((len(samples), classes), np.float32)
    for row, prediction in enumerate(predictor(samples)):
        out[row, prediction.ranked.indices] = prediction.ranked.scores
    return out


def converted(model: LoadedModel, precision: str, channels_last: bool) -> LoadedModel:
    """A copy of ``model`` in this setting, as ``InferenceEngine.load`` converts one."""
    from app.models.precision import Numerics

    numerics = Numerics(precision, channels_last)
    module = copy.deepcopy(model.module)
    numerics.module(module)
    return dataclasses.replace(model, module=module, numerics=numerics)


def memory_per_image(check: Check, predictor: Predictor, n: int) -> int | None:
    """(peak of a batch of n - peak of a batch of 1) / (n - 1), from the allocator; None
    on the CPU or with n = 1."""
    if not check.cuda_ready or n < 2:
        return None
    import torch

    peaks = []
    for size in (1, n):
        batch = check.samples(size)
        torch.cuda.synchronize(check.dev)
        before = torch.cuda.memory_allocated(check.dev)
        torch.cuda.reset_peak_memory_stats(check.dev)
        predictor(batch)
        torch.cuda.synchronize(check.dev)
        peaks.append(torch.cuda.max_memory_allocated(check.dev) - before)
    return (peaks[1] - peaks[0]) // (n - 1)


def images_per_s(check: Check, predictor: Predictor, n: int, seconds: float) -> float:
    batch = check.samples(n)
    predictor(batch)  # cuDNN's plan for this shape and setting, chosen once
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        predictor(batch)
        done += n
    return done / (time.perf_counter() - started)


def agrees(reference: np.ndarray, got: np.ndarray, difference: float) -> bool:
    import numpy as np

    ranked = np.sort(reference, axis=1)
    decided = ranked[:, -1] - ranked[:, -2] > 2 * difference
    same = reference.argmax(axis=1) == got.argmax(axis=1)
    return bool(difference <= SCORE_TOLERANCE and same[decided].all())


def measure(check: Check, trial: LoadedModel, samples: list[Sample], reference: np.ndarray,
            n: int, seconds: float) -> dict[str, Any]:
    """One setting against fp32's ``reference`` scores, and its speed and memory."""
    from app.engine.predictor import Predictor

    predictor = Predictor(trial, keep_all=True)
    got = all_scores(predictor, samples, trial.num_classes)
    difference = float(abs(got - reference).max())
    return {"largest_difference": round(difference, 6),
            "top1_same": [bool(a == b) for a, b in zip(got.argmax(axis=1),
                                                       reference.argmax(axis=1), strict=True)],
            "agrees": agrees(reference, got, difference),
            "images_per_s": round(images_per_s(check, predictor, n, seconds), 1),
            "memory_per_image_bytes": memory_per_image(check, predictor, n)}


def precision(check: Check, out: dict[str, Any]) -> str:
    import torch

    from app.engine.predictor import Predictor

    model, n = check.model, check.chosen
    samples = photo_samples(check, model)
    reference = all_scores(Predictor(model, keep_all=True), samples, model.num_classes)
    seconds = min(check.plan.seconds, max(0.2, check.steps.remaining() / 40))
    rows: list[dict[str, Any]] = []
    out.update(batch=n, seconds_each=round(seconds, 2), photos=[p.name for p in PHOTOS],
               score_tolerance=SCORE_TOLERANCE, rows=rows)
    for name, channels_last in SETTINGS:
        row: dict[str, Any] = {"precision": name, "channels_last": channels_last}
        rows.append(row)
        if name == "bf16" and check.cuda_ready and not torch.cuda.is_bf16_supported():
            row["skipped"] = "this GPU has no bf16"
            continue
        try:
            row.update(measure(check, converted(model, name, channels_last), samples,
                               reference, n, seconds))
        except Exception as exc:  # a setting this GPU or torch cannot run is an answer
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if check.cuda_ready:  # the copy is gone with measure's frame: its memory too
            torch.cuda.empty_cache()
        check.write()
    fp32 = rows[0].get("images_per_s") or 0.0
    for row in rows:
        if fp32 and "images_per_s" in row:
            row["ratio_to_fp32"] = round(row["images_per_s"] / fp32, 3)
    good = [r for r in rows if r.get("agrees")]
    best = max(good, key=lambda r: r["images_per_s"], default=rows[0])
    label = best["precision"] + (" channels_last" if best["channels_last"] else "")
    out["recommended"] = {"precision": best["precision"],
                          "channels_last": best["channels_last"],
                          "ratio_to_fp32": best.get("ratio_to_fp32"),
                          "on": check.device}
    return (f"fastest that agrees with fp32: {label} "
            f"({best.get('ratio_to_fp32')}x fp32's images/s at batch {n})")
