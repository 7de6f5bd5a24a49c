"""A real server and NVIDIA's own client, ``tritonclient.http``, unchanged: health,
metadata, and inference with encoded files (binary and JSON), the classification
extension and preprocessed pixels; each gives the espresso photo the scores /v1/classify
gives it."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import numpy as np
import pytest
from images import photo
from live_server import LiveServer

from app.config import load_settings
from app.imaging.decoding import open_image
from app.imaging.pixels import model_input
from app.models.efficientnet_lite import preprocessing

httpclient = pytest.importorskip("tritonclient.http")
InferenceServerException = pytest.importorskip("tritonclient.utils").InferenceServerException
MODEL = "efficientnet_lite0"
ESPRESSO = 967
TOLERANCE = 1e-4


def triton(server: LiveServer) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url.removeprefix("http://"),
                                            connection_timeout=60, network_timeout=60)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[httpclient.InferenceServerClient]:
    connection = triton(server)
    yield connection
    connection.close()


@pytest.fixture(scope="module")
def v1_scores(server: LiveServer) -> np.ndarray:
    """The espresso photo's probability of every class, from /v1/classify."""
    with server.client() as http:
        answer = http.post("/v1/classify", params={"top_k": 1000}, content=photo(),
                           headers={"Content-Type": "image/jpeg"})
    assert answer.status_code == 200, answer.text
    scores = np.zeros(1000, dtype=np.float32)
    for prediction in answer.json()["predictions"]:
        scores[prediction["index"]] = prediction["score"]
    assert int(scores.argmax()) == ESPRESSO
    return scores


def image(binary: bool, count: int = 1) -> httpclient.InferInput:
    """The photo as IMAGE: its bytes, or in JSON base64 (a JPEG file is not text)."""
    tensor = httpclient.InferInput("IMAGE", [count], "BYTES")
    data = photo() if binary else base64.b64encode(photo())
    tensor.set_data_from_numpy(np.array([data] * count, dtype=np.object_), binary_data=binary)
    return tensor


def assert_espresso(probabilities: np.ndarray, v1_scores: np.ndarray) -> None:
    assert probabilities.dtype == np.float32 and probabilities.shape[1:] == (1000,)
    for row in probabilities:
        assert int(row.argmax()) == ESPRESSO
        np.testing.assert_allclose(row, v1_scores, atol=TOLERANCE, rtol=0)


def test_health_and_metadata(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL)
    assert not client.is_model_ready("no_such_model")
    meta = client.get_model_metadata(MODEL)
    assert meta["name"] == MODEL and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "IMAGE", "datatype": "BYTES", "shape": [-1]},
                              {"name": "PIXELS", "datatype": "FP32",
                               "shape": [-1, 3, 224, 224]}]
    assert meta["outputs"] == [
        {"name": "PROBABILITIES", "datatype": "FP32", "shape": [-1, 1000]},
        {"name": "EMBEDDING", "datatype": "FP32", "shape": [-1, 1280]}]
    assert "classification" in client.get_server_metadata()["extensions"]


def test_encoded_files_in_binary(client: httpclient.InferenceServerClient,
                                 v1_scores: np.ndarray) -> None:
    """tritonclient's default: binary in, binary out (no outputs named)."""
    result = client.infer(MODEL, [image(binary=True, count=2)])
    assert_espresso(result.as_numpy("PROBABILITIES"), v1_scores)


def test_encoded_file_in_json(client: httpclient.InferenceServerClient,
                              v1_scores: np.ndarray) -> None:
    wanted = [httpclient.InferRequestedOutput("PROBABILITIES", binary_data=False)]
    result = client.infer(MODEL, [image(binary=False)], outputs=wanted)
    assert "data" in result.get_response()["outputs"][0]
    assert_espresso(result.as_numpy("PROBABILITIES"), v1_scores)


def test_classification_extension(client: httpclient.InferenceServerClient,
                                  v1_scores: np.ndarray) -> None:
    wanted = [httpclient.InferRequestedOutput("PROBABILITIES", class_count=3)]
    result = client.infer(MODEL, [image(binary=True)], outputs=wanted)
    classes = result.as_numpy("PROBABILITIES")
    assert classes.shape == (1, 3)
    parsed = [item.decode().split(":") for item in classes[0]]
    assert parsed[0][1:] == [str(ESPRESSO), "espresso"]
    for score, index, _ in parsed:
        assert abs(float(score) - v1_scores[int(index)]) < TOLERANCE
    assert [int(index) for _, index, _ in parsed] == list(np.argsort(-v1_scores)[:3])


def test_preprocessed_pixels(client: httpclient.InferenceServerClient,
                             v1_scores: np.ndarray) -> None:
    """The photo preprocessed here exactly as a decode worker does it."""
    spec = preprocessing(MODEL)
    opened = open_image(photo(), load_settings().max_image_pixels, spec.resize)
    pixels = model_input(opened, spec)[np.newaxis]
    tensor = httpclient.InferInput("PIXELS", list(pixels.shape), "FP32")
    tensor.set_data_from_numpy(pixels)
    result = client.infer(MODEL, [tensor])
    assert_espresso(result.as_numpy("PROBABILITIES"), v1_scores)


def test_errors_reach_the_client_with_their_message(
        client: httpclient.InferenceServerClient) -> None:
    tensor = httpclient.InferInput("PIXELS", [1, 3, 8, 8], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 3, 8, 8), dtype=np.float32))
    with pytest.raises(InferenceServerException) as refused:
        client.infer(MODEL, [tensor])
    assert refused.value.status() == "400"
    assert "[N, 3, 224, 224]" in refused.value.message()


def test_a_repeated_file_is_answered_from_the_result_cache(cached_server: LiveServer) -> None:
    connection = triton(cached_server)
    try:
        first, again = (connection.infer(MODEL, [image(binary=True)]).as_numpy("PROBABILITIES")
                        for _ in range(2))
    finally:
        connection.close()
    assert int(first.argmax()) == ESPRESSO
    np.testing.assert_array_equal(first, again)
    with cached_server.client() as http:
        assert http.get("/v1/stats").json()["requests"]["cached"] >= 1
