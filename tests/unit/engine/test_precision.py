"""The precision setting and channels_last on the CPU, with the real default model and
the shipped test photos: each agrees with fp32 (the espresso stays an espresso; the cat,
whose two best labels are 0.008 apart, keeps its label wherever fp32's margin exceeds
twice the largest score difference), and each is part of the result cache's key and the
profile's, so an answer or a measurement made one way is never taken for another.

Measured here (2026-12-06, a 2-core AVX-512-BF16 CPU, Lite0, both photos): the largest
score difference from fp32 is 3e-7 for channels_last, 0.005 for bf16, under 0.001
for fp16."""

from __future__ import annotations

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
from app.models.precision import FP32, Numerics, choose, cpu_has_bf16, requested

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


def test_the_result_cache_and_the_profile_key_tell_the_settings_apart(tmp_path):
    cpu = torch.device("cpu")
    keys = {numerics(cpu, n) for n in (FP32, Numerics("fp32", True), Numerics("bf16"),
                                       Numerics("fp16"))}
    assert len(keys) == 4 and numerics(cpu) == "cpu"
    names = {engine_with(tmp_path, precision=p, channels_last=c).calibration
             .profile_key("efficientnet_lite0", "v1").file_name()
             for p, c in (("auto", False), ("fp32", False), ("bf16", False), ("bf16", True))}
    assert len(names) == 4
    assert requested("bf16", True) == "bf16 channels_last"


def test_warmup_measures_the_model_as_it_runs(tmp_path):
    """Warmup runs its batches through the converted model (an fp32 batch into bf16
    weights would fail) and stores the profile under the settings it ran with."""
    engine = engine_with(tmp_path, precision="bf16", channels_last=True, max_batch_size=2)
    runtime = engine.warm_up(engine.load())
    assert runtime.memory.weights_bytes == sum(
        p.numel() * p.element_size() for p in (*runtime.model.module.parameters(),
                                               *runtime.model.module.buffers()))
    stored = [p.read_text() for p in (tmp_path / "profiles").glob("*.json")]
    label = "bf16 channels_last" if cpu_has_bf16() else "fp32 channels_last"
    assert runtime.model.numerics.label == label
    assert len(stored) == 1 and '"numerics": "bf16 channels_last"' in stored[0]
    engine.stop()
