"""The precision setting and channels_last on the CPU, with the real default model and
the shipped test photos: each agrees with fp32 (the espresso stays an espresso; the cat,
whose two best labels are 0.008 apart, keeps its label wherever fp32's margin exceeds
twice the largest score difference), and each is part of the result cache's key and the
profile's, so an answer or a measurement made one way is never taken for another.

Measured here (2026-12-06, a 2-core AVX-512-BF16 CPU, Lite0, both photos): the largest
score difference from fp32 is 3e-7 for channels_last, 0.005 for bf16, under 0.001
for fp16."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from images import photo

from app.config import load_settings
from app.engine.engine import InferenceEngine
from app.engine.predictor import Predictor, Sample, numerics
from app.imaging.decoding import open_image
from app.imaging.pixels import model_input
from app.models import LoadedModel
from app.models.precision import FP32, Numerics, choose, cpu_has_bf16
from app.models.registry import load_model

PHOTOS = ("coffee.jpg", "chelsea.jpg")
SCORE_TOLERANCE = 0.02


def engine_with(tmp_path: Path, **settings: object) -> InferenceEngine:
    return InferenceEngine(load_settings(device="cpu", log_dir=tmp_path / "logs",
                                         profile_dir=tmp_path / "profiles", **settings))


def scores(model: LoadedModel) -> np.ndarray:
    """Every class's score for each test photo, through the predictor serving uses."""
    spec = model.preprocessing
    samples = [Sample(torch.from_numpy(model_input(open_image(photo(name), 10**8,
                                                              spec.resize), spec).copy()),
                      model.num_classes) for name in PHOTOS]
    predictions = Predictor(model, keep_all=True)(samples)
    out = np.zeros((len(samples), model.num_classes), np.float32)
    for row, prediction in enumerate(predictions):
        out[row, prediction.ranked.indices] = prediction.ranked.scores
    return out


@pytest.fixture(scope="module")
def fp32_scores(tmp_path_factory) -> np.ndarray:
    return scores(engine_with(tmp_path_factory.mktemp("fp32")).load())


@pytest.mark.parametrize(("precision", "channels_last"), [
    ("fp32", True), ("bf16", False), ("bf16", True), ("fp16", False)])
def test_each_setting_agrees_with_fp32_on_the_test_photos(
        tmp_path, fp32_scores, precision, channels_last):
    model = engine_with(tmp_path, precision=precision, channels_last=channels_last).load()
    expected = "fp32" if precision == "bf16" and not cpu_has_bf16() else precision
    assert model.numerics == Numerics(expected, channels_last)
    assert next(model.module.parameters()).dtype == model.numerics.dtype
    got = scores(model)
    difference = float(np.abs(got - fp32_scores).max())
    assert difference < SCORE_TOLERANCE, difference
    assert model.labels[int(got[0].argmax())] == "espresso"
    ranked = np.sort(fp32_scores, axis=1)
    for row in range(len(PHOTOS)):
        if ranked[row, -1] - ranked[row, -2] > 2 * difference:
            assert got[row].argmax() == fp32_scores[row].argmax(), PHOTOS[row]


def test_bf16_halves_the_weights(tmp_path):
    if not cpu_has_bf16():
        pytest.skip("this CPU has no bf16: the model runs in fp32 (tested above)")
    full = engine_with(tmp_path / "a").load()
    half = engine_with(tmp_path / "b", precision="bf16").load()
    size = [sum(p.numel() * p.element_size() for p in m.module.parameters())
            for m in (full, half)]
    assert size[1] * 2 == size[0]


def test_auto_is_fp32_until_measured(tmp_path):
    assert engine_with(tmp_path).load().numerics == FP32


def test_a_saved_program_runs_as_it_was_saved_and_the_log_says_so(caplog):
    caplog.set_level(logging.WARNING, "vramguard.engine")
    for family in ("torchscript", "export"):
        assert choose("bf16", True, torch.device("cuda"), family, "mine") == FP32
    assert "mine is a export program and runs as it was saved (fp32), not in bf16 " \
           "channels_last" in caplog.text
    assert choose("bf16", True, torch.device("cuda"), "onnx", "mine") == Numerics("bf16", True)


def test_the_result_cache_and_the_profile_key_tell_the_numerics_apart(tmp_path):
    """Both are keyed by what the model runs in, not by the words of the settings: auto
    and fp32 share a measurement, and bf16 on a CPU without it is the fp32 one."""
    cpu = torch.device("cpu")
    keys = {numerics(cpu, n) for n in (FP32, Numerics("fp32", True), Numerics("bf16"),
                                       Numerics("fp16"))}
    assert len(keys) == 4 and numerics(cpu) == "cpu"

    def key(precision: str, channels_last: bool = False) -> str:
        return engine_with(tmp_path, precision=precision, channels_last=channels_last
                           ).calibration.profile_key("efficientnet_lite0", "v1").file_name()

    assert key("auto") == key("fp32") != key("fp32", True) != key("fp16")
    assert (key("bf16") != key("fp32")) == cpu_has_bf16()


def test_bf16_weights_agree_with_fp32_even_where_the_cpu_emulates_them(tmp_path,
                                                                       fp32_scores):
    """The conversion itself, whatever this CPU has (the setting falls back to fp32 on a
    CPU without bf16, so the test above would compare fp32 with fp32 there)."""
    model = engine_with(tmp_path).load()
    Numerics("bf16", True).module(model.module)
    model = dataclasses.replace(model, numerics=Numerics("bf16", True))
    difference = float(np.abs(scores(model) - fp32_scores).max())
    assert 0 < difference < SCORE_TOLERANCE, difference


def test_the_device_receives_the_converted_weights(tmp_path):
    """The model is built on the CPU and converted there before it moves: the device
    never holds an fp32 copy of weights it keeps in half precision."""
    asked: list[torch.device] = []

    def recorded(name: str, device: torch.device, weights: Path | None) -> LoadedModel:
        asked.append(device)
        return load_model(name, device, weights)

    engine = InferenceEngine(load_settings(device="cpu", log_dir=tmp_path / "logs",
                                           profile_dir=tmp_path / "profiles",
                                           precision="fp16", channels_last=True),
                             model_loader=recorded)
    model = engine.load()
    assert asked == [torch.device("cpu")]
    weight = next(p for p in model.module.parameters() if p.dim() == 4)
    assert weight.dtype == torch.float16 and weight.device == engine.device
    assert weight.is_contiguous(memory_format=torch.channels_last)


def test_warmup_measures_the_model_as_it_runs(tmp_path):
    """Warmup runs its batches through the converted model (an fp32 batch into bf16
    weights would fail) and stores the profile under what it ran in."""
    engine = engine_with(tmp_path, precision="bf16", channels_last=True, max_batch_size=2)
    runtime = engine.warm_up(engine.load())
    assert runtime.memory.weights_bytes == sum(
        p.numel() * p.element_size() for p in (*runtime.model.module.parameters(),
                                               *runtime.model.module.buffers()))
    stored = [p.read_text() for p in (tmp_path / "profiles").glob("*.json")]
    label = "bf16 channels_last" if cpu_has_bf16() else "fp32 channels_last"
    assert runtime.model.numerics.label == label
    assert len(stored) == 1 and f'"numerics": "{label}"' in stored[0]
    engine.stop()
