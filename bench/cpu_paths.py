"""The forward pass on this CPU, every way torch offers, and two JPEG decoders.

    python -m bench.cpu_paths [--model efficientnet_lite0] [--seconds 4] [--rounds 3]

For the model (default: the built-in one), in one run with interleaved rounds:

- **fp32 eager**: what vramguard runs on a CPU today;
- **channels_last**: the same numbers, the weights and inputs in NHWC order;
- **jit frozen**: ``torch.jit.trace`` + ``freeze`` + ``optimize_for_inference`` (oneDNN
  fusion, no compiler needed at run time; deprecated in torch 2.14);
- **bf16 autocast**: where the CPU has bf16 instructions;
- **int8**: post-training static quantization, torch's x86 backend (FX graph mode,
  calibrated on the photos below; ``torch.ao.quantization`` is deprecated in 2.14).

Each gives images/s model-only (batch 4, pixels ready) and end to end (decode +
preprocess + forward, batch 4), and against fp32 eager on the test photos (the two in
``tests/data``, each also mirrored and centre-cropped: 8 inputs) the top-1 agreement and
the largest difference in any class's score (softmax). Then the decoders: Pillow with
draft mode (what the decode worker uses) against ``simplejpeg``'s scaled decode, on
the 600x400 photo and the 2400x1600 one of ``bench.goodput`` (``pip install simplejpeg``
for that row; the benchmark runs without it).
"""

from __future__ import annotations

import argparse
import copy
import io
import statistics
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from PIL import Image, ImageOps

from app.imaging.decoding import open_image
from app.imaging.pixels import model_input
from app.models import DEFAULT_MODEL, LoadedModel, load_model
from app.models.precision import cpu_has_bf16
from bench.goodput import large_photo
from bench.process import ROOT
from bench.run import machine

BATCH = 4
PHOTOS = [ROOT / "tests" / "data" / name for name in ("coffee.jpg", "chelsea.jpg")]
MAX_PIXELS = 40_000_000

Forward = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Variant:
    name: str
    forward: Forward
    context: Callable[[], AbstractContextManager[object]] = nullcontext
    channels_last: bool = False
    model_only: list[float] = field(default_factory=list)
    end_to_end: list[float] = field(default_factory=list)


def _photo_bytes() -> list[bytes]:
    """The test photos, each as sent, mirrored and centre-cropped to its middle 60 %,
    plus one mirror of the crop: eight inputs."""
    out = []
    for path in PHOTOS:
        with Image.open(path) as image:
            rgb = image.convert("RGB")
        width, height = rgb.size
        crop = rgb.crop((width // 5, height // 5, width * 4 // 5, height * 4 // 5))
        for variant in (rgb, ImageOps.mirror(rgb), crop, ImageOps.mirror(crop)):
            buffer = io.BytesIO()
            variant.save(buffer, "JPEG", quality=92)
            out.append(buffer.getvalue())
    return out


def _pixels(model: LoadedModel, data: bytes) -> torch.Tensor:
    spec = model.preprocessing
    return torch.from_numpy(model_input(open_image(data, MAX_PIXELS, spec.resize), spec))


def _paths(model: LoadedModel, example: torch.Tensor, calibration: torch.Tensor) -> list[Variant]:
    module = model.module
    paths = [Variant("fp32 eager", module)]
    nhwc = _copy(model).to(memory_format=torch.channels_last)
    paths.append(Variant("channels_last", nhwc, channels_last=True))
    with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(_copy(model), example)
        frozen = torch.jit.optimize_for_inference(torch.jit.freeze(traced.eval()))
    paths.append(Variant("jit frozen", frozen))
    if cpu_has_bf16():
        paths.append(Variant("bf16 autocast", module,
                           lambda: torch.autocast("cpu", dtype=torch.bfloat16)))
    quantized = _int8(model, example, calibration)
    if quantized is not None:
        paths.append(Variant("int8 (x86)", quantized))
    return paths


def _copy(model: LoadedModel) -> torch.nn.Module:
    return copy.deepcopy(model.module).eval()


def _int8(model: LoadedModel, example: torch.Tensor,
          calibration: torch.Tensor) -> torch.nn.Module | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.ao.quantization import get_default_qconfig_mapping
            from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

            torch.backends.quantized.engine = "x86"
            prepared = prepare_fx(_copy(model), get_default_qconfig_mapping("x86"), (example,))
            with torch.no_grad():
                prepared(calibration)
            converted: torch.nn.Module = convert_fx(prepared)
            return converted
    except Exception as exc:  # a model FX cannot trace: say so in the table
        print(f"int8: not possible for {model.name}: {type(exc).__name__}: {exc}")
        return None


def _run(path: Variant, batch: torch.Tensor) -> torch.Tensor:
    if path.channels_last:
        batch = batch.contiguous(memory_format=torch.channels_last)
    with torch.inference_mode(), path.context():
        return path.forward(batch).float().softmax(-1)


def _rate(work: Callable[[], object], seconds: float) -> float:
    work()
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        work()
        done += BATCH
    return done / (time.perf_counter() - started)


def _decoders(photos: dict[str, bytes], size: int, seconds: float) -> list[str]:
    """Pillow with draft mode against simplejpeg's scaled decode (the smallest scale that
    still covers `size`), images/s each."""
    rows = []
    try:
        import simplejpeg
    except ImportError:
        simplejpeg = None
    for name, data in photos.items():
        pillow = _rate(lambda data=data: [open_image(data, MAX_PIXELS, size).image.load()
                                          for _ in range(BATCH)], seconds)
        cells = [name, f"{pillow:.0f}"]
        if simplejpeg is not None:
            width, height = Image.open(io.BytesIO(data)).size
            scale = max((n for n in (1, 2, 4, 8) if min(width, height) // n >= size),
                        default=1)

            def scaled(data: bytes = data, least: tuple[int, int] = (width // scale,
                                                                      height // scale)) -> None:
                for _ in range(BATCH):
                    simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=True,
                                           fastupsample=True, min_width=least[0],
                                           min_height=least[1])

            fast = _rate(scaled, seconds)
            cells += [f"{fast:.0f}", f"{fast / pillow:.2f}", f"1/{scale}"]
        else:
            cells += ["not installed", "", ""]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = load_model(args.model, torch.device("cpu"))
    photos = _photo_bytes()
    inputs = torch.stack([_pixels(model, data) for data in photos])
    example = inputs[:BATCH].clone()
    paths = _paths(model, example, inputs)
    reference = _run(paths[0], inputs)
    for _ in range(args.rounds):
        for path in paths:
            def whole(path: Variant = path) -> torch.Tensor:
                return _run(path, torch.stack([_pixels(model, photos[i % len(photos)])
                                               for i in range(BATCH)]))

            path.model_only.append(_rate(lambda path=path: _run(path, example), args.seconds))
            path.end_to_end.append(_rate(whole, args.seconds))
    print(f"machine: {machine()}; torch {torch.__version__}; threads "
          f"{torch.get_num_threads()}; model {args.model}, batch {BATCH}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; median of "
          f"{args.rounds} interleaved rounds of {args.seconds:.0f} s\n")
    print("| forward pass | model-only img/s | x fp32 | end to end img/s | x fp32 | "
          "top-1 agrees | largest score difference |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    base_model = statistics.median(paths[0].model_only)
    base_e2e = statistics.median(paths[0].end_to_end)
    for path in paths:
        scores = _run(path, inputs)
        agree = int((scores.argmax(-1) == reference.argmax(-1)).sum())
        worst = float((scores - reference).abs().max())
        model_only = statistics.median(path.model_only)
        e2e = statistics.median(path.end_to_end)
        print(f"| {path.name} | {model_only:.1f} | {model_only / base_model:.2f} | "
              f"{e2e:.1f} | {e2e / base_e2e:.2f} | {agree} of {len(photos)} | {worst:.2g} |")
    print(f"\ndecoding only (pixels, no resize), at the smallest scale still at least "
          f"{model.preprocessing.resize} px on the short side, batches of {BATCH}\n")
    print("| photo | Pillow draft img/s | simplejpeg scaled img/s | x Pillow | scale |")
    print("| --- | --- | --- | --- | --- |")
    with Image.open(PHOTOS[0]) as image:
        small = f"coffee.jpg {image.size[0]}x{image.size[1]}"
    decoders = {small: PHOTOS[0].read_bytes(), "2400x1600 (bench.goodput)": large_photo()}
    print("\n".join(_decoders(decoders, model.preprocessing.resize, args.seconds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
