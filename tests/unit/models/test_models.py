"""The model registry: the default model, torchvision models from local files, clear errors."""

from __future__ import annotations

import pytest
import torch
import torchvision.models
from model_pixels import CPU, probabilities

from app.models import ModelLoadError, available_models, load_model, resolve_weights
from app.models.efficientnet_lite import PREPROCESSING


def test_default_model_loads_offline_in_eval_mode():
    model = load_model("efficientnet_lite0", CPU)
    assert not model.module.training
    assert model.num_classes == 1000 and model.labels[967] == "espresso"
    assert model.preprocessing == PREPROCESSING
    assert len(model.weights_version) == 16


def test_inception_normalisation_beats_imagenet_statistics():
    """The preprocessing the weights were trained with gives the higher confidence."""
    from dataclasses import replace

    model = load_model("efficientnet_lite0", CPU)
    imagenet = replace(PREPROCESSING, mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375))
    scores = {}
    for name, spec in (("inception", PREPROCESSING), ("imagenet", imagenet)):
        probs = probabilities(model, spec)
        assert int(probs.argmax()) == 967
        scores[name] = float(probs[967])
    assert scores["inception"] > scores["imagenet"] + 0.05


def test_torchvision_model_from_a_local_weights_file(tmp_path):
    reference = torchvision.models.get_model("mobilenet_v3_small", weights=None).eval()
    path = tmp_path / "mnv3s.pth"
    torch.save(reference.state_dict(), path)
    model = load_model("mobilenet_v3_small", CPU, path)
    assert model.preprocessing.crop == 224 and model.preprocessing.resize == 256
    assert model.preprocessing.mean[0] == pytest.approx(0.485 * 255)
    x = torch.randn(2, 3, 224, 224)
    with torch.inference_mode():
        assert torch.allclose(model.module(x), reference(x))


def test_missing_torchvision_weights_say_where_to_put_them(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError) as info:
        resolve_weights("resnet50")
    message = str(info.value)
    assert "resnet50-11ad3fa6.pth" in message and str(tmp_path / "hub" / "checkpoints") in message
    assert "--weights" in message


def test_weights_from_torchvisions_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    (tmp_path / "checkpoints").mkdir()
    cached = tmp_path / "checkpoints" / "resnet18-f37072fd.pth"
    cached.write_bytes(b"x")
    assert resolve_weights("resnet18") == cached


def test_errors_for_unknown_models_and_wrong_files(tmp_path):
    with pytest.raises(ModelLoadError, match="Unknown model 'nope'"):
        resolve_weights("nope")
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_weights("resnet18", tmp_path / "absent.pth")
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ModelLoadError, match="is damaged or incomplete"):
        load_model("resnet18", CPU, garbage)
    other = tmp_path / "other.pth"
    torch.save(torchvision.models.get_model("mobilenet_v3_small").state_dict(), other)
    with pytest.raises(ModelLoadError, match="does not fit model 'resnet18'"):
        load_model("resnet18", CPU, other)


def test_available_models_lists_the_default_first():
    names = available_models()
    assert names[:3] == ["efficientnet_lite0", "efficientnet_lite1", "efficientnet_lite2"]
    assert "resnet50" in names
