"""Own model folders as the untrusted input they are: each bad one is refused at ``add``
with a message that names the problem, and leaves nothing behind in the models folder.

The models are real (tiny torch modules, TorchScript and ONNX files written here, a
timm architecture's real state dict); the trial is the real child process.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from app.models.own.description import describe_folder
from app.models.own.manifest import FolderError
from app.models.own.store import OwnModels
from app.models.own.trial import run_trial
from app.models.sources import is_builtin

LABELS = "red\ngreen\nblue\n"
MANIFEST = """task = "classify"
labels = "labels.txt"

[model]
format = "{format}"
file = "{file}"
{extra}
[preprocessing]
size = 32
"""


class Tiny(nn.Module):
    """A classifier with ``outputs`` scores per image, batch-independent."""

    def __init__(self, outputs: int = 3, shape: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(3, outputs)
        self.shape = shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(self.pool(x).flatten(1))
        return out.reshape(x.shape[0], *self.shape) if self.shape else out


def torchscript_folder(root: Path, name: str = "tiny", module: nn.Module | None = None,
                       labels: str = LABELS, extra: str = "") -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    scripted = torch.jit.trace((module or Tiny()).eval(), torch.randn(2, 3, 32, 32))
    scripted.save(str(folder / "model.pt"))
    (folder / "labels.txt").write_text(labels, encoding="utf-8")
    (folder / "vramguard.toml").write_text(
        MANIFEST.format(format="torchscript", file="model.pt", extra=extra), encoding="utf-8")
    return folder


def timm_folder(root: Path, name: str = "timmy") -> Path:
    import timm

    folder = root / name
    folder.mkdir(parents=True)
    module = timm.create_model("test_byobnet", num_classes=3)
    safetensors.torch.save_file(module.state_dict(), str(folder / "weights.safetensors"))
    (folder / "labels.txt").write_text(LABELS, encoding="utf-8")
    (folder / "vramguard.toml").write_text(
        MANIFEST.format(format="timm", file="weights.safetensors",
                        extra='architecture = "test_byobnet"\n'), encoding="utf-8")
    return folder


@pytest.fixture
def store(tmp_path) -> OwnModels:
    return OwnModels(tmp_path / "models", timeout_s=120, reserved=is_builtin)


def refused(store: OwnModels, folder: Path, *needles: str) -> str:
    """Add ``folder``; it must be refused naming each needle, leaving nothing behind."""
    with pytest.raises(FolderError) as caught:
        store.add(folder)
    message = str(caught.value)
    for needle in needles:
        assert needle in message, message
    left = sorted(p.name for p in store.root.iterdir()) if store.root.exists() else []
    assert left in ([], [".checked"]), left
    assert store.scan(force=True) == []
    return message


def test_a_good_folder_is_added_listed_and_removed(store, tmp_path):
    added = store.add(torchscript_folder(tmp_path / "src"), "shapes")
    assert added.description is not None and added.description.labels == ("red", "green",
                                                                          "blue")
    assert [e.name for e in store.scan(force=True)] == ["shapes"]
    assert (store.root / ".checked" / "shapes.json").is_file()
    store.remove("shapes")
    assert store.scan(force=True) == [] and not (store.root / "shapes").exists()


def test_a_label_count_that_is_not_the_models_output_is_refused(store, tmp_path):
    refused(store, torchscript_folder(tmp_path, labels="red\ngreen\nblue\nyellow\n"),
            "answers 3 scores", "labels list 4")


def test_a_classify_manifest_without_labels_is_refused(store, tmp_path):
    folder = torchscript_folder(tmp_path)
    manifest = folder / "vramguard.toml"
    manifest.write_text(manifest.read_text().replace('labels = "labels.txt"\n', ""))
    refused(store, folder, "vramguard.toml", "needs labels")


def test_a_missing_labels_file_is_refused(store, tmp_path):
    folder = torchscript_folder(tmp_path)
    (folder / "labels.txt").unlink()
    refused(store, folder, "no file 'labels.txt'")


@pytest.mark.parametrize(("change", "needles"), [
    (("size = 32", "size = 32\ncolour_space = \"rgb\""),
     ("vramguard.toml", "[preprocessing] colour_space", "not a field")),
    (('task = "classify"', 'task = "detect"'), ("vramguard.toml", "task", "classify")),
    (("size = 32", "size = -4"), ("vramguard.toml", "[preprocessing] size")),
    (('format = "torchscript"', 'format = "keras"'), ("vramguard.toml", "[model] format")),
    (("size = 32", "size = 32\nmean = [123.7, 116.3, 103.5]"), ("0-1 units",)),
    (('task = "classify"', 'task = "classify'), ("not valid TOML",)),
])
def test_a_manifest_with_an_unknown_field_or_a_bad_value_is_refused(store, tmp_path, change,
                                                                     needles):
    folder = torchscript_folder(tmp_path)
    manifest = folder / "vramguard.toml"
    manifest.write_text(manifest.read_text().replace(*change))
    refused(store, folder, *needles)


def test_a_pickle_where_safetensors_should_be_is_refused_and_never_unpickled(store,
                                                                              tmp_path):
    folder = timm_folder(tmp_path)
    marker = tmp_path / "unpickled"

    class Trap:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"x": Trap()}, folder / "weights.safetensors")
    refused(store, folder, "weights.safetensors", "is a pickle", "safetensors.torch")
    assert not marker.exists()


def test_a_hugging_face_folder_with_only_a_pickled_bin_is_refused_with_the_conversion(
        store, tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architecture": "test_byobnet",
                                                    "num_classes": 3}))
    torch.save({"w": torch.zeros(1)}, folder / "pytorch_model.bin")
    refused(store, folder, "pytorch_model.bin", "a pickle", "save_file(", "weights_only=True")


def test_a_link_out_of_the_folder_is_refused(store, tmp_path):
    folder = torchscript_folder(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("a\nb\nc\n")
    (folder / "labels.txt").unlink()
    os.symlink(secret, folder / "labels.txt")
    refused(store, folder, "labels.txt", "outside the folder")


def test_a_safetensors_header_that_claims_more_than_the_file_is_refused(store, tmp_path):
    folder = timm_folder(tmp_path)
    weights = folder / "weights.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(struct.pack("<Q", len(data) * 100) + data[8:])
    refused(store, folder, "weights.safetensors", "damaged", "claims")


def test_a_safetensors_tensor_that_claims_bytes_past_the_end_is_refused(store, tmp_path):
    folder = timm_folder(tmp_path)
    weights = folder / "weights.safetensors"
    data = weights.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    key = next(k for k in header if k != "__metadata__")
    header[key]["shape"] = [10**6, 10**6]
    header[key]["data_offsets"] = [0, 4 * 10**12]
    text = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])
    refused(store, folder, "weights.safetensors", "claims bytes the file does not have")


def test_an_onnx_operator_that_does_not_convert_is_refused(store, tmp_path):
    import onnx
    from onnx import TensorProto, helper

    folder = tmp_path / "onnxy"
    folder.mkdir()
    graph = helper.make_graph(
        [helper.make_node("GlobalAveragePool", ["image"], ["pooled"]),
         helper.make_node("Flatten", ["pooled"], ["flat"]),
         helper.make_node("Teleport", ["flat"], ["scores"], domain="com.example")],
        "odd", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["n", 3, 32, 32])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["n", 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.example", 1)])
    onnx.save(model, str(folder / "model.onnx"))
    (folder / "labels.txt").write_text(LABELS)
    (folder / "vramguard.toml").write_text(MANIFEST.format(format="onnx", file="model.onnx",
                                                           extra=""))
    refused(store, folder, "Teleport", "cannot be converted")


def test_a_model_whose_output_is_not_the_shape_its_task_needs_is_refused(store, tmp_path):
    refused(store, torchscript_folder(tmp_path, module=Tiny(6, shape=(3, 2))),
            "answers shape (1, 3, 2)", "(1, N)")


@pytest.mark.parametrize("file", ["model.pt", "labels.txt"])
def test_a_file_of_0_bytes_is_refused(store, tmp_path, file):
    folder = torchscript_folder(tmp_path)
    (folder / file).write_bytes(b"")
    refused(store, folder, file, "empty (0 bytes)")


def test_a_name_that_is_a_built_in_models_or_not_a_name_is_refused(store, tmp_path):
    folder = torchscript_folder(tmp_path)
    for name in ("efficientnet_lite0", "resnet18", "../x", "A", ".hidden", "a/b", ""):
        with pytest.raises(FolderError):
            store.add(folder, name)
    assert not store.root.exists() or store.scan(force=True) == []


def test_a_folder_put_there_by_hand_is_found_and_a_broken_one_does_not_hide_the_others(
        store, tmp_path):
    store.root.mkdir(parents=True)
    torchscript_folder(store.root, "good")
    broken = torchscript_folder(store.root, "broken")
    (broken / "vramguard.toml").write_text("task = 1\n")
    entries = {e.name: e for e in store.scan(force=True)}
    assert entries["good"].description is not None and entries["good"].error == ""
    assert entries["broken"].description is None and "vramguard.toml" in entries[
        "broken"].error
    assert store.ensure_checked("good")  # the trial, once
    with pytest.raises(FolderError, match=r"vramguard\.toml"):
        store.ensure_checked("broken")


def test_an_edited_folder_is_described_again_and_checked_again(store, tmp_path):
    store.root.mkdir(parents=True)
    folder = torchscript_folder(store.root, "good")
    first = store.ensure_checked("good")
    (folder / "labels.txt").write_text("a\nb\nc\nd\n")
    store.scan(force=True)
    with pytest.raises(FolderError, match="labels list 4"):
        store.ensure_checked("good")
    (folder / "labels.txt").write_text("a\nb\nc\n")
    store.scan(force=True)
    assert store.ensure_checked("good") != first  # other labels: another fingerprint


def test_the_trial_stops_a_load_past_its_time_limit(tmp_path):
    folder = torchscript_folder(tmp_path)
    with pytest.raises(FolderError, match="longer than 0 s"):
        run_trial(folder, "torchscript", timeout_s=0.3)


def test_the_trial_refuses_a_model_the_computers_free_memory_cannot_load(tmp_path):
    folder = torchscript_folder(tmp_path)
    with pytest.raises(FolderError, match=r"needs about .* GiB of the computer's memory and "
                                          r"only 0\.1 GiB is free"):
        run_trial(folder, "onnx", timeout_s=60, available=lambda: 2**30 // 10)


def test_a_description_reads_a_timm_hugging_face_folder_without_a_manifest(tmp_path):
    import timm

    folder = tmp_path / "hf"
    module = timm.create_model("test_byobnet", num_classes=3)
    module.pretrained_cfg = {**module.pretrained_cfg, "input_size": (3, 48, 48),
                             "crop_pct": 0.75, "interpolation": "bicubic",
                             "mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25)}
    timm.models.save_for_hf(module, str(folder), model_config={"label_names": ["a", "b",
                                                                               "c"]},
                            safe_serialization=True)
    described = describe_folder(folder)
    spec = described.preprocessing
    assert (described.format, described.labels, described.architecture) == (
        "timm-hf", ("a", "b", "c"), "test_byobnet")
    assert (spec.crop, spec.resize, spec.interpolation, spec.mean, spec.std) == (
        48, 64, "bicubic", (127.5,) * 3, (63.75,) * 3)


def test_an_onnx_model_with_equal_weights_shared_by_identity_nodes_loads(store, tmp_path):
    """torch.onnx.export writes equal tensors once, behind Identity nodes (two zero biases
    here, as in a model just initialised): onnx2torch looked for the second among the
    initializers and the folder was refused with a bare "'onnx::Conv_…'"."""
    from app.models.own.loading import load_own

    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3), nn.AdaptiveAvgPool2d(1),
                           nn.Flatten(), nn.Linear(4, 3)).eval()
    with torch.no_grad():
        for conv in (module[0], module[1]):
            conv.bias.zero_()
    folder = tmp_path / "shared"
    folder.mkdir()
    torch.onnx.export(module, (torch.randn(2, 3, 32, 32),), folder / "model.onnx",
                      dynamo=False, opset_version=17, input_names=["image"],
                      output_names=["scores"], dynamic_axes={"image": {0: "n"}})
    import onnx

    assert any(n.op_type == "Identity" for n in onnx.load(str(folder / "model.onnx")).graph.node)
    (folder / "labels.txt").write_text(LABELS)
    (folder / "vramguard.toml").write_text(MANIFEST.format(format="onnx", file="model.onnx",
                                                           extra=""))
    added = store.add(folder, "shared")
    loaded = load_own(added, store.ensure_checked("shared"), torch.device("cpu"))
    pixels = torch.randn(5, 3, 32, 32)
    with torch.inference_mode():
        assert torch.allclose(loaded.module(pixels), module(pixels), atol=1e-5)
