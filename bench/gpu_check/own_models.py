"""The own-models step: a model of the user's own, from a ``torch.export`` program (.pt2)
and from ONNX, added as ``vramguard models add`` adds it (its trial load in a child
process), then loaded on the device by the engine, measured, and asked.

The model is made here by the machine's own torch (a small seeded convolutional classifier
for three labels), so nothing is carried for it: ``torch.export`` writes the .pt2 and
torch's TorchScript ONNX exporter (opset 17) the ONNX file. Reading ONNX takes the onnx and
onnx2torch packages, which the carry has no room for beside the Lite weight wheels;
without them the ONNX half is skipped and says so. Each answer is compared with the same
model run on the CPU here.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.gpu_check.runner import Skip
from bench.gpu_check.state import Check

if TYPE_CHECKING:
    from torch import nn

LABELS = ("red", "green", "blue")
SIZE = 32
SCORE_TOLERANCE = 1e-2  # TF32 convolutions on the GPU against fp32 on the CPU
MANIFEST = """task = "classify"
labels = "labels.txt"

[model]
format = "{format}"
file = "{file}"

[preprocessing]
size = {size}
resize = {size}
mean = [0.5, 0.5, 0.5]
std = [0.25, 0.25, 0.25]
"""


def small_classifier() -> nn.Module:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 3)).eval()


def write_folder(folder: Path, form: str, module: nn.Module) -> Path:
    """``module`` as a model folder of format ``form`` ("export" or "onnx")."""
    import torch

    folder.mkdir(parents=True)
    example = torch.zeros(2, 3, SIZE, SIZE)
    if form == "export":
        batch = torch.export.Dim("batch", min=1, max=1024)
        program = torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
        file = "model.pt2"
        torch.export.save(program, folder / file)
    else:
        file = "model.onnx"
        torch.onnx.export(module, (example,), folder / file, dynamo=False, opset_version=17,
                          input_names=["pixels"], output_names=["scores"],
                          dynamic_axes={"pixels": {0: "batch"}, "scores": {0: "batch"}})
    (folder / "labels.txt").write_text("\n".join(LABELS) + "\n", encoding="utf-8")
    (folder / "vramguard.toml").write_text(MANIFEST.format(format=form, file=file, size=SIZE),
                                           encoding="utf-8")
    return folder


def own_models(check: Check, out: dict[str, Any]) -> str:
    if check.cuda and not check.cuda_ready:
        raise Skip("no CUDA context (see cuda_context)")
    from app.models.own.store import OwnModels

    root = check.workdir / "own-models"
    store = OwnModels(root, timeout_s=60.0)
    module = small_classifier()
    forms = ["export"]
    if all(importlib.util.find_spec(name) for name in ("onnx", "onnx2torch")):
        forms.append("onnx")
    else:
        out["onnx"] = {"status": "skipped", "reason": "onnx and onnx2torch are not installed "
                       "here (the 64 MiB carry is full with the Lite weight wheels)"}
    done = []
    for form in forms:
        name = f"own-{form}"
        record: dict[str, Any] = {"name": name}
        out[form] = record
        started = time.monotonic()
        store.add(write_folder(check.workdir / "own-source" / form, form, module), name)
        record["add_seconds"] = round(time.monotonic() - started, 2)
        record.update(serve_one(check, root, name, module))
        check.write()
        done.append(f"{form}: {record['weights_bytes']} B of weights on {record['device']}, "
                     f"largest score difference {record['largest_difference']:.1e}")
    return "; ".join(done)


def serve_one(check: Check, root: Path, name: str, reference: nn.Module) -> dict[str, Any]:
    """``name`` loaded by a fresh engine as its model, asked for a batch of inputs, and
    compared with ``reference`` on the CPU; the engine is stopped and freed after."""
    import torch

    from app.engine.engine import InferenceEngine
    from app.engine.predictor import Sample

    settings = check.settings(model=name, models_dir=root, max_batch_size=8, batch_size=8,
                              target_latency_ms=check.plan.target_latency_ms,
                              profile_dir=check.workdir / "own-profiles")
    engine = InferenceEngine(settings)
    allocated = torch.cuda.memory_allocated(check.dev) if check.cuda_ready else 0
    pixels = torch.randn(8, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))

    async def load_and_ask() -> dict[str, Any]:
        await engine.start()
        runtime = engine.runtimes.get(name)
        if runtime is None:
            raise RuntimeError(f"{name} did not load: {engine.health.error}")
        weights = (torch.cuda.memory_allocated(check.dev) - allocated if check.cuda_ready
                   else runtime.memory.weights_bytes)
        rows = []
        for one in pixels.unbind(0):
            with engine.admit(60.0, name) as place:
                answer = await engine.classify(Sample(one, 3), 60.0, place, name)
            order = [int(i) for i in answer.ranked.indices]
            scores = [float(s) for s in answer.ranked.scores]
            rows.append([scores[order.index(label)] for label in range(3)])
        parameter = next(runtime.model.module.parameters(), None)
        return {"device": str(parameter.device if parameter is not None else check.device),
                "weights_bytes": int(weights),
                "bytes_per_image": int(runtime.memory.fit.bytes_per_sample),
                "batch_size": runtime.guard.max_batch, "scores": rows}

    try:
        result = asyncio.run(load_and_ask())
        with torch.inference_mode():
            expected = torch.softmax(reference(pixels), dim=1)
        difference = float((torch.tensor(result.pop("scores")) - expected).abs().max())
        if difference > SCORE_TOLERANCE:
            check.fail("wrong_answer", "own_models", f"{name} on {check.device} answered "
                       f"{difference:.3g} away from the same model on the CPU")
        return {**result, "largest_difference": difference}
    finally:
        engine.stop()
        gc.collect()
        if check.cuda_ready:
            torch.cuda.empty_cache()
