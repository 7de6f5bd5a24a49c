"""Your own model, end to end: the worked examples in docs/own_models train small models
on pictures of their own classes and write them every way vramguard reads them; each
folder is added with `vramguard models add` to a running server (no restart), listed,
and classifies new pictures right, with its own labels, through /v1/classify, /v2 with
NVIDIA's tritonclient, the Python client and `vramguard classify`; then it is removed
while loaded and stops being served.

Every answer is compared with the same model run here, in the test process, on the same
pixels vramguard's own decode path makes: the largest score difference for each format
is printed (run with -s) and must stay within 1e-4.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import vramguard_client as vg
from live_server import ROOT, USER_DIRS, LiveServer, live_server
from torch import nn

from app.imaging.decoding import open_image
from app.imaging.pixels import model_input
from app.models.own.description import describe_folder

httpclient = pytest.importorskip("tritonclient.http")
EXAMPLES = ROOT / "docs" / "own_models"
TOLERANCE = 1e-4  # fp32: the served scores against the model run here
PICTURES = 20  # new pictures per model, none of them seen in training
PNG = {"Content-Type": "image/png"}
RIGHT = 0.95  # the share of new pictures each model must get right (measured: 99-100 %)
LABELS = ("red", "green", "blue")
REMOVED_WITHIN_S = 30.0  # the models folder is read every few seconds; upkeep each second


def example(name: str) -> Any:
    """A script of docs/own_models, imported as the docs say to run it."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


@dataclass
class Made:
    """One model folder and the model it was written from (its raw outputs)."""

    folder: Path
    outputs: Callable[[torch.Tensor], torch.Tensor]
    task: str = "classify"


@dataclass
class Pictures:
    files: list[bytes]  # PNG: lossless, so vramguard and the test read the same pixels
    classes: list[int]


def png(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def pictures() -> Pictures:
    pairs = example("shapes_data").make_images(PICTURES, seed=424_242)
    return Pictures([png(image) for image, _ in pairs], [label for _, label in pairs])


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Made]:
    """Every example: each format of the timm classifier, its torchvision model, the
    transformers one, and the multilabel and embedding models (name in vramguard ->
    folder and the model trained here)."""
    out = tmp_path_factory.mktemp("made")
    train_timm = example("train_timm")
    classifier = train_timm.train_model(0)
    folders = {f"shapes-{form}": Made(folder, classifier)
               for form, folder in train_timm.save_all(classifier, out).items()}
    torchvision_model = train_timm.train_torchvision_model(0)
    folders["shapes-torchvision"] = Made(train_timm.save_torchvision(torchvision_model, out),
                                         torchvision_model)
    train_transformers = example("train_transformers")
    hugging_face = train_transformers.train_model(0)
    folders["shapes-transformers"] = Made(train_transformers.save(hugging_face, out),
                                          lambda pixels: hugging_face(pixel_values=pixels).logits)
    others = example("multilabel_and_embed")
    tagger = others.train_multilabel(0)
    folders["shapes-multilabel"] = Made(
        others.save(tagger, out / "multilabel", "multilabel", threshold=others.THRESHOLD),
        tagger, "multilabel")
    features = others.embedding_model(classifier)
    folders["shapes-embed"] = Made(others.save(features, out / "embed", "embed",
                                               num_classes=0), features, "embed")
    return folders


def classifiers(made: dict[str, Made]) -> dict[str, Made]:
    return {name: one for name, one in made.items() if one.task == "classify"}


def in_process(made: Made, files: list[bytes]) -> np.ndarray:
    """The model run here on the pixels vramguard's decode path makes of ``files``, its
    outputs made scores as its task's answers are: softmax, sigmoid or unit length."""
    spec = describe_folder(made.folder).preprocessing
    pixels = np.stack([model_input(open_image(data, 64 * 2**20, spec.resize), spec)
                       for data in files])
    with torch.inference_mode():
        raw = made.outputs(torch.from_numpy(pixels))
    scores = {"classify": lambda: torch.softmax(raw, dim=1),
              "multilabel": lambda: torch.sigmoid(raw),
              "embed": lambda: nn.functional.normalize(raw, dim=1)}[made.task]()
    return np.asarray(scores)


def labels_here(made: Made, pictures: Pictures) -> list[str]:
    """What the model, run here, names each picture; most of them right."""
    named = in_process(made, pictures.files).argmax(axis=1)
    assert np.mean(named == np.array(pictures.classes)) >= RIGHT
    return [LABELS[index] for index in named]


def cli_env(home: Path, models_dir: Path) -> dict[str, str]:
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("VRAMGUARD_")}
    return {**inherited, **{var: str(home / var.lower()) for var in USER_DIRS},
            "VRAMGUARD_MODELS_DIR": str(models_dir)}


def vramguard(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "app", *args], env=env, text=True,
                          capture_output=True, timeout=300, cwd=ROOT)


@dataclass
class Appliance:
    server: LiveServer
    env: dict[str, str]  # what `vramguard models ...` runs with: the server's models folder


@pytest.fixture(scope="module")
def appliance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    """A running server whose models folder is empty when it starts."""
    tmp = tmp_path_factory.mktemp("own-server")
    models_dir = tmp / "models"
    # Ten models load within a minute here, for one client; the defaults allow six, three
    # of them to one client (against churn).
    env = {"VRAMGUARD_MODELS_DIR": str(models_dir), "VRAMGUARD_RATE_LIMIT": "0",
           "VRAMGUARD_MAX_LOADS_PER_MINUTE": "30",
           "VRAMGUARD_MAX_LOADS_PER_CLIENT_PER_MINUTE": "30"}
    with live_server(tmp, "--no-cache", env=env) as server:
        yield Appliance(server, cli_env(tmp / "cli-home", models_dir))


@pytest.fixture(scope="module")
def added(appliance: Appliance, made: dict[str, Made]) -> dict[str, Made]:
    """Every folder added to the running server, two at a time, as a user would."""
    def add(name: str) -> subprocess.CompletedProcess[str]:
        return vramguard(appliance.env, "models", "add", str(made[name].folder), "--name", name)

    with ThreadPoolExecutor(2) as pool:
        for name, result in zip(made, pool.map(add, made), strict=True):
            assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"
    return made


def listing(server: LiveServer) -> dict[str, dict[str, Any]]:
    with server.client() as http:
        answer = http.get("/v1/models")
    assert answer.status_code == 200, answer.text
    return {m["name"]: m for m in answer.json()["models"]}


def classify(server: LiveServer, name: str, files: list[bytes]) -> np.ndarray:
    """Each file's score for every label, by index, from /v1/classify."""
    rows = []
    with server.client() as http:
        for data in files:
            answer = http.post("/v1/classify", params={"model": name, "top_k": 3},
                               content=data, headers=PNG)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == name
            row = np.zeros(3, dtype=np.float32)
            for prediction in answer.json()["predictions"]:
                row[prediction["index"]] = prediction["score"]
                assert prediction["label"] == LABELS[prediction["index"]]
            rows.append(row)
    return np.stack(rows)


def test_cli_adds_and_lists_every_format_without_a_restart(
        appliance: Appliance, added: dict[str, Made]) -> None:
    listed = vramguard(appliance.env, "models", "list")
    assert listed.returncode == 0, listed.stderr
    models = listing(appliance.server)
    for name, one in added.items():
        assert name in listed.stdout
        entry = models[name]
        labels = 0 if one.task == "embed" else 3
        assert (entry["task"], entry["labels"], entry["installed"]) == (one.task, labels, True)
        assert entry["state"] == "available"
    assert models["shapes-onnx"]["format"] == "onnx"
    assert models["shapes-timm-hf"]["format"] == "timm-hf"
    assert models["shapes-transformers"]["format"] == "transformers"


def test_every_format_classifies_new_pictures_right_and_as_the_model_does_here(
        appliance: Appliance, added: dict[str, Made], pictures: Pictures) -> None:
    differences = {}
    for name, one in classifiers(added).items():
        served = classify(appliance.server, name, pictures.files)
        expected = in_process(one, pictures.files)
        assert [LABELS[i] for i in served.argmax(axis=1)] == labels_here(one, pictures), name
        differences[name] = float(np.abs(served - expected).max())
    print("largest score difference, served against run in the test:",
          json.dumps({name: f"{value:.1e}" for name, value in differences.items()}))
    assert max(differences.values()) <= TOLERANCE, differences
    models = listing(appliance.server)
    for name in classifiers(added):
        assert models[name]["state"] == "loaded" and models[name]["weights_bytes"] > 0


def test_tritonclient_reads_each_models_own_labels_and_shape(
        appliance: Appliance, added: dict[str, Made], pictures: Pictures) -> None:
    client = httpclient.InferenceServerClient(appliance.server.url.removeprefix("http://"),
                                              connection_timeout=60, network_timeout=60)
    try:
        for name, one in classifiers(added).items():
            meta = client.get_model_metadata(name)
            assert meta["outputs"][0] == {"name": "PROBABILITIES", "datatype": "FP32",
                                          "shape": [-1, 3]}
            assert {"name": "PIXELS", "datatype": "FP32",
                    "shape": [-1, 3, 64, 64]} in meta["inputs"]
            tensor = httpclient.InferInput("IMAGE", [len(pictures.files)], "BYTES")
            tensor.set_data_from_numpy(np.array(pictures.files, dtype=np.object_))
            result = client.infer(name, [tensor])
            probabilities = result.as_numpy("PROBABILITIES")
            np.testing.assert_allclose(probabilities, in_process(one, pictures.files),
                                       atol=TOLERANCE, rtol=0)
            wanted = [httpclient.InferRequestedOutput("PROBABILITIES", class_count=1)]
            top = client.infer(name, [tensor], outputs=wanted).as_numpy("PROBABILITIES")
            labels = [row[0].decode().split(":")[2] for row in top]
            assert labels == labels_here(one, pictures), name
    finally:
        client.close()


def test_the_python_client_and_the_cli_name_the_models_own_labels(
        appliance: Appliance, added: dict[str, Made], pictures: Pictures,
        tmp_path: Path) -> None:
    with vg.Client(appliance.server.url) as client:
        info = {m.name: m for m in client.models()}
        for name, one in classifiers(added).items():
            assert info[name].labels == 3 and info[name].task == "classify"
            answers = [client.classify(data, top_k=3, model=name) for data in pictures.files]
            assert [a.top.label for a in answers] == labels_here(one, pictures), name
    for index, data in enumerate(pictures.files):
        (tmp_path / f"{index:02d}.png").write_bytes(data)
    tagged = vramguard(appliance.env, "classify", "--url", appliance.server.url, "--json",
                       "--model", "shapes-onnx", "--top-k", "1", str(tmp_path))
    assert tagged.returncode == 0, tagged.stderr
    lines = sorted((json.loads(line) for line in tagged.stdout.splitlines()),
                   key=lambda line: line["path"])
    assert [line["predictions"][0]["label"] for line in lines] == labels_here(
        added["shapes-onnx"], pictures)


def test_a_multilabel_model_names_every_colour_in_the_picture_above_the_threshold(
        appliance: Appliance, added: dict[str, Made]) -> None:
    name, one = "shapes-multilabel", added["shapes-multilabel"]
    pairs = example("shapes_data").make_multilabel_images(PICTURES, seed=515_151)
    files = [png(image) for image, _ in pairs]
    expected = in_process(one, files)
    right = [set(present) == set(np.flatnonzero(row > 0.5)) for (_, present), row
             in zip(pairs, expected, strict=True)]
    assert np.mean(right) >= RIGHT
    largest = 0.0
    with appliance.server.client() as http, vg.Client(appliance.server.url) as client:
        for data, row in zip(files, expected, strict=True):
            for threshold in (None, 0.9):
                params: dict[str, Any] = {"model": name}
                if threshold is not None:
                    params["threshold"] = threshold
                answer = http.post("/v1/classify", params=params, content=data, headers=PNG)
                assert answer.status_code == 200, answer.text
                body = answer.json()
                cut = 0.5 if threshold is None else threshold
                assert body["threshold"] == cut
                assert [p["label"] for p in body["labels"]] == [
                    LABELS[i] for i in np.argsort(-row) if row[i] > cut]
                for p in body["labels"]:
                    largest = max(largest, abs(p["score"] - row[p["index"]]))
            answered = client.classify(data, model=name)
            assert answered.labels is not None and answered.threshold == 0.5
            assert {p.label for p in answered.labels} == {
                LABELS[i] for i in np.flatnonzero(row > 0.5)}
    print(f"multilabel: largest score difference {largest:.1e}")
    assert largest <= TOLERANCE


def test_an_embedding_model_answers_its_features_through_v1_embed_and_v2(
        appliance: Appliance, added: dict[str, Made], pictures: Pictures) -> None:
    name, one = "shapes-embed", added["shapes-embed"]
    expected = in_process(one, pictures.files)
    with appliance.server.client() as http:
        served = []
        for data in pictures.files:
            answer = http.post("/v1/embed", params={"model": name}, content=data, headers=PNG)
            assert answer.status_code == 200, answer.text
            assert answer.json()["dimensions"] == expected.shape[1]
            served.append(answer.json()["embedding"])
        refused = http.post("/v1/classify", params={"model": name}, content=pictures.files[0],
                            headers=PNG)
        assert refused.status_code == 400 and "embed" in refused.text, refused.text
    largest = float(np.abs(np.array(served) - expected).max())
    print(f"embed: largest difference {largest:.1e}")
    assert largest <= TOLERANCE
    # Pictures of the same colour lie closer together than pictures of different colours.
    similar = expected @ expected.T
    same = np.equal.outer(pictures.classes, pictures.classes)
    assert similar[same].mean() > similar[~same].mean() + 0.5
    client = httpclient.InferenceServerClient(appliance.server.url.removeprefix("http://"),
                                              connection_timeout=60, network_timeout=60)
    try:
        meta = client.get_model_metadata(name)
        assert [o["name"] for o in meta["outputs"]] == ["EMBEDDING"]
        tensor = httpclient.InferInput("IMAGE", [len(pictures.files)], "BYTES")
        tensor.set_data_from_numpy(np.array(pictures.files, dtype=np.object_))
        vectors = client.infer(name, [tensor]).as_numpy("EMBEDDING")
        np.testing.assert_allclose(vectors, expected, atol=TOLERANCE, rtol=0)
    finally:
        client.close()


def test_a_model_removed_while_loaded_is_unloaded_and_no_longer_served(
        appliance: Appliance, added: dict[str, Made], pictures: Pictures) -> None:
    name = "shapes-torchscript"
    classify(appliance.server, name, pictures.files[:1])  # loaded
    removed = vramguard(appliance.env, "models", "remove", name)
    assert removed.returncode == 0, removed.stderr
    deadline = time.monotonic() + REMOVED_WITHIN_S
    while name in listing(appliance.server) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert name not in listing(appliance.server)
    with appliance.server.client() as http:
        answer = http.post("/v1/classify", params={"model": name}, content=pictures.files[0],
                           headers=PNG)
        assert answer.status_code == 404, answer.text
        metrics = http.get("/metrics").text
    assert f'vramguard_model_unloads_total{{model="{name}",reason="removed"}} 1.0' in metrics
    assert f"unloaded {name} (removed)" in appliance.server.log_text()
    # The same name again, another format of the same model: served at once.
    again = vramguard(appliance.env, "models", "add", str(added["shapes-onnx"].folder),
                      "--name", name)
    assert again.returncode == 0, again.stderr
    served = classify(appliance.server, name, pictures.files)
    assert [LABELS[i] for i in served.argmax(axis=1)] == labels_here(added["shapes-onnx"],
                                                                      pictures)
    assert listing(appliance.server)[name]["format"] == "onnx"


def test_serve_takes_one_of_your_models_as_its_default_model(
        appliance: Appliance, added: dict[str, Made], pictures: Pictures,
        tmp_path: Path) -> None:
    """`vramguard serve --model NAME` for a model of the models folder (it was refused as
    an unknown model before the server even started)."""
    models_dir = appliance.env["VRAMGUARD_MODELS_DIR"]
    with live_server(tmp_path, "--no-cache", "--model", "shapes-onnx",
                     env={"VRAMGUARD_MODELS_DIR": models_dir}) as server, \
            server.client() as http:
        answer = http.post("/v1/classify", content=pictures.files[0], headers=PNG)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "shapes-onnx"
        expected = labels_here(added["shapes-onnx"], pictures)[0]
        assert answer.json()["predictions"][0]["label"] == expected
