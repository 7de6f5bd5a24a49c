"""The frozen graph on the CPU (``precision = auto``): the real default model's graph
answers as the module does on the test photos; warmup keeps it only where it is faster
(the measurement passed in, so the choice is the test's), stores the choice in the
profile and a later load takes it from there; a model whose trace is wrong, or that
cannot be traced, serves as it is; ``fp32`` never builds one; and a batch that asks for a
classifier's features runs the module, whose last layer the features are hooked on."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from images import photo
from tiny_model import tiny_model
from torch import nn

from app.config import load_settings
from app.engine.engine import InferenceEngine
from app.engine.predictor import CLASSIFY, EMBED, Predictor, Sample
from app.imaging.decoding import open_image
from app.imaging.pixels import model_input
from app.models import DEFAULT_MODEL, LoadedModel, cpu_graph, load_model

PHOTOS = ("coffee.jpg", "chelsea.jpg")
CPU = torch.device("cpu")


def never(module: nn.Module, graph: nn.Module, batch: torch.Tensor) -> float:
    raise AssertionError("a stored profile's choice is not measured again")


def engine_with(tmp_path: Path, speedup: cpu_graph.Speedup, model: LoadedModel | None = None,
                **settings: object) -> InferenceEngine:
    def loader(name: str, device: torch.device, weights: Path | None) -> LoadedModel:
        return model if model is not None else load_model(name, device, weights)

    return InferenceEngine(load_settings(device="cpu", cache=False, max_batch_size=2,
                                         log_dir=tmp_path / "logs",
                                         profile_dir=tmp_path / "profiles", **settings),
                           model_loader=loader, graph_speedup=speedup)


def photo_batch(model: LoadedModel) -> torch.Tensor:
    spec = model.preprocessing
    return torch.stack([torch.from_numpy(model_input(open_image(photo(name), 10**8,
                                                                spec.resize), spec).copy())
                        for name in PHOTOS])


def stored_profiles(tmp_path: Path) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in (tmp_path / "profiles").glob("*.json")]


def test_the_default_models_graph_answers_as_the_module_on_the_test_photos() -> None:
    model = load_model(DEFAULT_MODEL, CPU)
    spec = model.preprocessing
    graph = cpu_graph.build(model.module, cpu_graph.check_inputs(
        spec.channels, spec.crop, torch.float32, torch.contiguous_format), model.task, "lite0")
    assert graph is not None
    batch = photo_batch(model)
    with torch.inference_mode():
        module_scores = model.module(batch).softmax(-1)
        graph_scores = graph(batch).softmax(-1)
    assert float((module_scores - graph_scores).abs().max()) < 1e-4  # 8e-7 measured
    assert torch.equal(module_scores.argmax(-1), graph_scores.argmax(-1))
    assert model.labels[int(graph_scores[0].argmax())] == "espresso"


def test_a_faster_graph_serves_and_the_profile_keeps_the_choice(tmp_path: Path,
                                                              caplog) -> None:
    caplog.set_level(logging.INFO, "vramguard.engine")
    engine = engine_with(tmp_path, lambda module, graph, batch: 1.5)
    runtime = engine.warm_up(engine.load())
    assert runtime.predictor.graph is not None
    assert runtime.model.numerics.label == "fp32 graph"
    parameters = sum(p.numel() * p.element_size() for p in (
        *runtime.model.module.parameters(), *runtime.model.module.buffers()))
    assert runtime.memory.weights_bytes == 2 * parameters  # the graph's copy counted
    assert "runs as a frozen graph: 1.50x as fast" in caplog.text
    samples = [Sample(pixels, 3) for pixels in photo_batch(runtime.model)]
    answers = runtime.predictor(samples)
    assert runtime.model.labels[int(answers[0].ranked.indices[0])] == "espresso"
    engine.stop()
    [profile] = stored_profiles(tmp_path)
    assert profile["graph"] is True and profile["key"]["numerics"] == "fp32 graph"

    again = engine_with(tmp_path, never)
    reused = again.warm_up(again.load())
    assert reused.reused_profile and reused.predictor.graph is not None
    assert "its stored profile found it faster" in caplog.text
    again.stop()


def test_a_graph_that_is_not_faster_is_not_kept_nor_built_again(tmp_path: Path,
                                                                 caplog) -> None:
    engine = engine_with(tmp_path, lambda module, graph, batch: 1.0, tiny_model())
    runtime = engine.warm_up(engine.load())
    assert runtime.predictor.graph is None and runtime.model.numerics.label == "fp32"
    engine.stop()
    [profile] = stored_profiles(tmp_path)
    assert profile["graph"] is False

    caplog.set_level(logging.INFO, "vramguard.engine")
    again = engine_with(tmp_path, never, tiny_model())
    assert again.warm_up(again.load()).predictor.graph is None
    assert "frozen graph" not in caplog.text  # not built, so neither checked nor timed
    again.stop()


def test_fp32_runs_the_module_and_measures_no_graph(tmp_path: Path) -> None:
    engine = engine_with(tmp_path, never, tiny_model(), precision="fp32")
    runtime = engine.warm_up(engine.load())
    assert runtime.predictor.graph is None and runtime.model.numerics.label == "fp32"
    engine.stop()


class Counting(nn.Module):
    """A module whose answer changes with a Python counter: a trace takes the counter's
    value at tracing time as a constant, so its graph answers differently afterwards."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x) * self.calls


class Branching(nn.Module):
    """A module that takes one path or another by its input's values, which a trace
    would fix at the path its example took (the tracer warns)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) if x.mean() > 0 else -self.inner(x)


class Dictionary(nn.Module):
    """A module with a dict for output, which the tracer refuses."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.inner(x)}


@pytest.mark.parametrize(("wrapper", "reason"), [
    (Counting, "its scores differ by up to"),
    (Branching, "it cannot be built (its Python code depends on its input"),
    (Dictionary, "it cannot be built")])
def test_a_model_whose_graph_is_wrong_or_impossible_serves_as_it_is(
        tmp_path: Path, caplog, wrapper: type[nn.Module], reason: str) -> None:
    caplog.set_level(logging.INFO, "vramguard.engine")
    model = tiny_model()
    model = LoadedModel(model.name, wrapper(model.module), model.labels, model.preprocessing,
                        model.weights_file, model.weights_version, model.device)
    spec = model.preprocessing
    inputs = cpu_graph.check_inputs(spec.channels, spec.crop, torch.float32,
                                    torch.contiguous_format)
    assert cpu_graph.build(model.module, inputs, model.task, "mine") is None
    assert f"mine runs as it is, not as a frozen graph: {reason}" in caplog.text


def test_a_batch_that_asks_for_features_runs_the_module() -> None:
    model = load_model(DEFAULT_MODEL, CPU)
    spec = model.preprocessing
    graph = cpu_graph.build(model.module, cpu_graph.check_inputs(
        spec.channels, spec.crop, torch.float32, torch.contiguous_format), model.task, "lite0")
    assert graph is not None
    calls: list[int] = []

    class Recorded(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(len(x))
            return graph(x)

    predictor = Predictor(model, keep_all=False, graph=Recorded())
    pixels = photo_batch(model)
    classified = predictor([Sample(p, 1, CLASSIFY) for p in pixels])
    assert calls == [2]
    mixed = predictor([Sample(pixels[0], 1, CLASSIFY), Sample(pixels[1], 1, EMBED)])
    assert calls == [2]  # the module ran: its hook gave the features
    assert mixed[1].embedding is not None and mixed[1].embedding.shape == (model.feature_dim,)
    assert mixed[0].ranked.indices[0] == classified[0].ranked.indices[0]


def test_disagreement_is_the_largest_score_difference() -> None:
    logits = torch.tensor([[4.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    assert cpu_graph.disagreement(logits, logits + 1e-6, "classify") is None
    assert cpu_graph.disagreement(logits, logits[:, :2], "classify") == \
        "its output has another shape"
    moved = logits.clone()
    moved[0, 1] = 4.5
    assert cpu_graph.disagreement(logits, moved, "classify").startswith(
        "its scores differ by up to")
    assert cpu_graph.disagreement(logits, torch.full_like(logits, float("nan")),
                                  "classify") is not None
    # a multilabel model's scores are sigmoids, an embedding's its normalised features
    assert cpu_graph.disagreement(logits, logits + 0.05, "multilabel") is None
    assert cpu_graph.disagreement(logits, logits * 3, "embed") is None
    assert cpu_graph.disagreement(logits, logits.flip(-1), "embed") is not None
    assert np.isclose(cpu_graph.SCORE_TOLERANCE, 0.02)
