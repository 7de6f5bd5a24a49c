"""The Open Inference Protocol routes (/v2) in process, on the stand-in engine: metadata,
readiness, inference in JSON and in Triton's binary tensor format with either input,
malformed bodies, places in line, and the protocol's error shape from routes and gates."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from asgi import (
    LABELS,
    built_app,
    client,
    error_message,
    png,
    state_of,
)
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.api.oip_codec import (
    HEADER_LENGTH,
    MAX_IMAGES,
    MAX_JSON_BYTES,
    pack_bytes,
    parse_request,
    unpack_bytes,
)
from app.engine.predictor import CLASSIFY, EMBED, Prediction, Ranked, Sample
from app.errors import ApiError
from app.http.scope import route_family

pytestmark = pytest.mark.anyio
MODEL = "efficientnet_lite0"  # the stand-in engine's model: crop 32, 10 classes, no features
INFER = f"/v2/models/{MODEL}/infer"
CROP = 32
# What ReadyEngine answers: class i has probability 0.05 * (i + 1).
STAND_IN = np.linspace(0.05, 0.5, len(LABELS), dtype=np.float32)


@pytest.fixture
def app(tmp_path: Path) -> Iterator[FastAPI]:
    """The real app on the stand-in engine; one decode process, started now, and a long
    request timeout: starting a process takes seconds on a busy test machine."""
    with built_app(tmp_path, ready=True, rate_limit=False, decode_workers=1,
                   request_timeout_s=60) as built:
        state_of(built).decoder.start()
        yield built


def oip_error(response: httpx.Response, status: int) -> str:
    """Assert the protocol's error answer, ``{"error": "message"}``; return the message."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    assert body["error"].strip()
    return str(body["error"])


def image_input(count: int = 1, image: bytes | None = None) -> dict[str, Any]:
    """IMAGE in JSON: base64 strings."""
    text = base64.b64encode(image or png()).decode()
    return {"name": "IMAGE", "datatype": "BYTES", "shape": [count], "data": [text] * count}


def binary_request(tensor: dict[str, Any], raw: bytes, **head: Any
                   ) -> tuple[bytes, dict[str, str]]:
    """A request in the binary tensor format: ``tensor``'s data after the JSON part."""
    tensor = {**tensor, "parameters": {"binary_data_size": len(raw)}}
    text = json.dumps({"inputs": [tensor], **head}).encode()
    return text + raw, {HEADER_LENGTH: str(len(text)), "Content-Type": "application/octet-stream"}


def outputs_of(response: httpx.Response) -> dict[str, np.ndarray]:
    """Every output of an answer, JSON or binary, in its shape."""
    assert response.status_code == 200, response.text
    body = response.content
    length = response.headers.get(HEADER_LENGTH)
    end = int(length) if length is not None else len(body)
    head = json.loads(body[:end])
    assert head["model_name"] == MODEL and head["model_version"] == "1"
    found, offset = {}, end
    for output in head["outputs"]:
        shape, count = output["shape"], math.prod(output["shape"])
        size = output.get("parameters", {}).get("binary_data_size")
        if size is None:
            data = output["data"]
            values = np.array(data, dtype=object if output["datatype"] == "BYTES" else "f4")
        elif output["datatype"] == "BYTES":
            items = unpack_bytes(body[offset:offset + size], count, output["name"])
            values = np.array([item.decode() for item in items], dtype=object)
        else:
            values = np.frombuffer(body[offset:offset + size], dtype="<f4")
        offset += size or 0
        found[output["name"]] = values.reshape(shape)
    assert offset == len(body)
    return found


# --- metadata and health ---------------------------------------------------------------


async def test_server_metadata_and_health(app: FastAPI) -> None:
    async with client(app) as http:
        meta = (await http.get("/v2")).json()
        assert (await http.get("/v2/health/live")).json() == {"live": True}
        assert (await http.get("/v2/health/ready")).json() == {"ready": True}
        state_of(app).engine.paused = True
        paused = await http.get("/v2/health/ready")
    assert meta["name"] == "vramguard" and meta["version"]
    assert sorted(meta["extensions"]) == ["binary_tensor_data", "classification"]
    assert "paused" in oip_error(paused, 503)


async def test_metadata_of_a_loaded_model_says_what_it_takes_and_gives(app: FastAPI) -> None:
    async with client(app) as http:
        meta = (await http.get(f"/v2/models/{MODEL}")).json()
        by_version = (await http.get(f"/v2/models/{MODEL}/versions/1")).json()
    assert meta == by_version
    assert meta["name"] == MODEL and meta["versions"] == ["1"] and meta["platform"]
    assert meta["inputs"] == [
        {"name": "IMAGE", "datatype": "BYTES", "shape": [-1]},
        {"name": "PIXELS", "datatype": "FP32", "shape": [-1, 3, CROP, CROP]}]
    # the stand-in model has no features: no EMBEDDING
    assert meta["outputs"] == [{"name": "PROBABILITIES", "datatype": "FP32",
                                "shape": [-1, len(LABELS)]}]


async def test_metadata_of_a_model_not_loaded_is_what_the_catalogue_knows(
        app: FastAPI) -> None:
    async with client(app) as http:
        meta = (await http.get("/v2/models/efficientnet_lite1")).json()
        ready = (await http.get("/v2/models/efficientnet_lite1/ready")).json()
    assert meta["inputs"][1]["shape"] == [-1, 3, 240, 240]
    assert meta["outputs"] == [
        {"name": "PROBABILITIES", "datatype": "FP32", "shape": [-1, 1000]},
        {"name": "EMBEDDING", "datatype": "FP32", "shape": [-1, -1]}]
    assert ready == {"name": "efficientnet_lite1", "ready": True, "loaded": False}
    assert "efficientnet_lite1" not in state_of(app).engine.runtimes  # nothing was loaded


async def test_model_readiness(app: FastAPI) -> None:
    async with client(app) as http:
        loaded = await http.get(f"/v2/models/{MODEL}/ready")
        by_version = await http.get(f"/v2/models/{MODEL}/versions/1/ready")
        unknown = await http.get("/v2/models/no_such_model/ready")
        other_version = await http.get(f"/v2/models/{MODEL}/versions/2/ready")
        meta_unknown = await http.get("/v2/models/no_such_model")
        state_of(app).engine.paused = True
        paused = await http.get(f"/v2/models/{MODEL}/ready")
    assert loaded.json() == by_version.json() == {"name": MODEL, "ready": True, "loaded": True}
    assert "no_such_model" in oip_error(unknown, 404)
    assert "version" in oip_error(other_version, 404)
    assert "no_such_model" in oip_error(meta_unknown, 404)
    oip_error(paused, 503)


# --- inference ---------------------------------------------------------------------------


async def test_json_inference_with_encoded_images(app: FastAPI) -> None:
    """Each file decoded by the decode processes (the /v1 path); all classes back."""
    async with client(app) as http:
        response = await http.post(INFER, json={"id": "42", "inputs": [image_input(2)]})
    assert response.json()["id"] == "42"
    probabilities = outputs_of(response)["PROBABILITIES"]
    assert probabilities.shape == (2, len(LABELS))
    np.testing.assert_array_equal(probabilities, [STAND_IN, STAND_IN])
    samples = state_of(app).engine.samples
    assert [(tuple(s.pixels.shape), s.top_k, s.task) for s in samples] == [
        ((3, CROP, CROP), len(LABELS), CLASSIFY)] * 2
    assert samples[0].pixels.dtype == torch.float32


async def test_json_inference_with_pixels_skips_decoding(app: FastAPI) -> None:
    pixels = np.random.default_rng(0).normal(size=(2, 3, CROP, CROP)).astype(np.float32)
    tensor = {"name": "PIXELS", "datatype": "FP32", "shape": [2, 3, CROP, CROP],
              "data": pixels.tolist()}  # nested; a flat list works too
    async with client(app) as http:
        response = await http.post(INFER, json={"inputs": [tensor]})
        flat = await http.post(INFER, json={"inputs": [{**tensor,
                                                         "data": pixels.ravel().tolist()}]})
    assert outputs_of(response)["PROBABILITIES"].shape == (2, len(LABELS))
    assert flat.status_code == 200
    samples = state_of(app).engine.samples
    np.testing.assert_array_equal(np.stack([s.pixels.numpy() for s in samples[:2]]), pixels)
    assert state_of(app).decoder.replaced == 0


async def test_classification_extension_in_json_and_binary(app: FastAPI) -> None:
    """Triton's format: "score:index:label", the score as C's %f."""
    wanted = [{"name": "PROBABILITIES", "parameters": {"classification": 3}}]
    async with client(app) as http:
        as_json = await http.post(INFER, json={"inputs": [image_input(2)], "outputs": wanted})
        wanted[0]["parameters"]["binary_data"] = True
        content, headers = binary_request({"name": "IMAGE", "datatype": "BYTES", "shape": [1]},
                                          pack_bytes([png()]), outputs=wanted)
        binary = await http.post(INFER, content=content, headers=headers)
        too_many = await http.post(INFER, json={"inputs": [image_input()], "outputs": [
            {"name": "PROBABILITIES", "parameters": {"classification": 5000}}]})
    top = ["0.500000:9:class-9", "0.450000:8:class-8", "0.400000:7:class-7"]
    assert outputs_of(as_json)["PROBABILITIES"].tolist() == [top, top]
    assert binary.headers["content-type"] == "application/octet-stream"
    assert outputs_of(binary)["PROBABILITIES"].tolist() == [top]
    assert outputs_of(too_many)["PROBABILITIES"].shape == (1, len(LABELS))  # as Triton: all


async def test_binary_round_trip_with_encoded_images(app: FastAPI) -> None:
    content, headers = binary_request({"name": "IMAGE", "datatype": "BYTES", "shape": [3]},
                                      pack_bytes([png(8), png(16), png(40)]),
                                      parameters={"binary_data_output": True})
    async with client(app) as http:
        response = await http.post(INFER, content=content, headers=headers)
    assert int(response.headers[HEADER_LENGTH]) < len(response.content)
    np.testing.assert_array_equal(outputs_of(response)["PROBABILITIES"], [STAND_IN] * 3)


async def test_binary_round_trip_with_pixels(app: FastAPI) -> None:
    pixels = np.arange(3 * CROP * CROP, dtype=np.float32).reshape(1, 3, CROP, CROP) / 100
    content, headers = binary_request(
        {"name": "PIXELS", "datatype": "FP32", "shape": [1, 3, CROP, CROP]},
        pixels.astype("<f4").tobytes(),
        outputs=[{"name": "PROBABILITIES", "parameters": {"binary_data": True}}])
    async with client(app) as http:
        response = await http.post(f"/v2/models/{MODEL}/versions/1/infer", content=content,
                                   headers=headers)
    np.testing.assert_array_equal(outputs_of(response)["PROBABILITIES"], [STAND_IN])
    sample = state_of(app).engine.samples[0]
    np.testing.assert_array_equal(sample.pixels.numpy(), pixels[0])


async def test_embedding_output_asks_for_features(app: FastAPI,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    engine = state_of(app).engine
    model = engine.runtimes[MODEL].model
    monkeypatch.setattr(model, "feature_dim", 4)
    seen: list[Sample] = []

    async def classify(sample: Sample, *args: Any, **kwargs: Any) -> Prediction:
        seen.append(sample)
        order = np.arange(len(LABELS))[::-1].copy()
        return Prediction(Ranked(order, STAND_IN[order]), 1,
                          np.array([0.5, 0.5, 0.5, 0.5], dtype=np.float32))

    monkeypatch.setattr(engine, "classify", classify)
    async with client(app) as http:
        meta = (await http.get(f"/v2/models/{MODEL}")).json()
        response = await http.post(INFER, json={"inputs": [image_input(2)], "outputs": [
            {"name": "EMBEDDING", "parameters": {"binary_data": True}},
            {"name": "PROBABILITIES"}]})
    assert meta["outputs"][1] == {"name": "EMBEDDING", "datatype": "FP32", "shape": [-1, 4]}
    outputs = outputs_of(response)
    np.testing.assert_array_equal(outputs["EMBEDDING"], np.full((2, 4), 0.5))
    np.testing.assert_array_equal(outputs["PROBABILITIES"], [STAND_IN, STAND_IN])
    assert [(s.task, s.top_k) for s in seen] == [(EMBED, len(LABELS))] * 2


async def test_the_images_of_one_request_wait_for_the_model_together(
        app: FastAPI, monkeypatch: pytest.MonkeyPatch) -> None:
    """All of them are in line at once (so they batch): none is answered until every one
    has been queued."""
    engine = state_of(app).engine
    count, queued = 5, []
    everyone = asyncio.Event()

    async def classify(sample: Sample, *args: Any, **kwargs: Any) -> Prediction:
        queued.append(sample)
        if len(queued) == count:
            everyone.set()
        await asyncio.wait_for(everyone.wait(), 10)
        return Prediction(Ranked(np.arange(len(LABELS)), STAND_IN), count)

    monkeypatch.setattr(engine, "classify", classify)
    async with client(app) as http:
        response = await http.post(INFER, json={"inputs": [image_input(count)]})
    assert outputs_of(response)["PROBABILITIES"].shape == (count, len(LABELS))


async def test_every_image_takes_its_own_place_in_line(tmp_path: Path) -> None:
    with built_app(tmp_path, ready=True, rate_limit=False, queue_size=2) as app:
        async with client(app) as http:
            response = await http.post(INFER, json={"inputs": [image_input(3)]})
        assert "too many images" in oip_error(response, 503)
        assert response.headers["Retry-After"]
        assert state_of(app).engine.batcher.backlog == 0  # every place given back


async def test_a_bad_file_among_several_is_named(app: FastAPI) -> None:
    tensor = image_input(2)
    tensor["data"][1] = base64.b64encode(b"not an image at all").decode()
    async with client(app) as http:
        response = await http.post(INFER, json={"inputs": [tensor]})
    assert oip_error(response, 400).startswith("IMAGE[1]: ")


# --- malformed requests ------------------------------------------------------------------

PIXELS_1 = {"name": "PIXELS", "datatype": "FP32", "shape": [1, 3, CROP, CROP]}
ONE_IMAGE = {"name": "IMAGE", "datatype": "BYTES", "shape": [1]}


def raw_body(head: bytes, tail: bytes, length: str) -> tuple[bytes, dict[str, str]]:
    return head + tail, {HEADER_LENGTH: length}


def malformed() -> dict[str, tuple[bytes, dict[str, str], str]]:
    """Bodies (and headers) that must get 400, with a word the message must hold."""
    plain_head = json.dumps({"inputs": [image_input()]}).encode()
    good_head = json.dumps({"inputs": [{**ONE_IMAGE,
                                        "parameters": {"binary_data_size": 8}}]}).encode()
    nan = np.zeros((1, 3, CROP, CROP), dtype=np.float32)
    nan[0, 1, 2, 3] = np.nan
    inf = nan.copy()
    inf[0, 1, 2, 3] = np.inf

    def as_json(body: object) -> tuple[bytes, dict[str, str]]:
        return json.dumps(body).encode(), {}

    def binary(tensor: dict[str, Any], raw: bytes) -> tuple[bytes, dict[str, str]]:
        return binary_request(tensor, raw)

    cases = {
        "not json": (b"{nope", {}, "JSON"),
        "not an object": (*as_json([1, 2]), "object"),
        "deeply nested": (b"[" * 100_000 + b"]" * 100_000, {}, "JSON"),
        "no inputs": (*as_json({"inputs": []}), "exactly one input"),
        "two inputs": (*as_json({"inputs": [image_input(), image_input()]}),
                       "exactly one input"),
        "unknown input": (*as_json({"inputs": [{**image_input(), "name": "INPUT0"}]}),
                          "INPUT0"),
        "header length not a number": (*raw_body(good_head, bytes(8), "12x"), "number"),
        "header length past the body": (*raw_body(good_head, bytes(8), "999999999"),
                                        "body has only"),
        "binary size past the body": (*raw_body(good_head, bytes(4),
                                                str(len(good_head))), "binary_data_size"),
        "binary data without its size": (*raw_body(plain_head, b"extra", str(len(plain_head))),
                                         "no binary_data_size"),
        "element length past the data": (*binary(ONE_IMAGE, struct.pack("<I", 1000) + b"abc"),
                                         "only 3 are left"),
        "element count short": (*binary({**ONE_IMAGE, "shape": [2]}, pack_bytes([png()])),
                                "ends before"),
        # fewer than 4 bytes left for a length: refused before they are read as one
        "three stray bytes for a length": (*binary({**ONE_IMAGE, "shape": [2]},
                                                   pack_bytes([png()]) + b"abc"),
                                           "ends before the length of element 1 (2 expected)"),
        "element length one past the data": (*binary(ONE_IMAGE, struct.pack("<I", 4) + b"abc"),
                                             "element 0 says it has 4 bytes, but only 3 are "
                                             "left"),
        "bytes left over": (*binary(ONE_IMAGE, pack_bytes([png(), png()])), "left after"),
        "image as FP32": (*as_json({"inputs": [{**image_input(), "datatype": "FP32"}]}),
                          "BYTES"),
        "pixels as BYTES": (*binary({**PIXELS_1, "datatype": "BYTES"}, nan.tobytes()),
                            "FP32"),
        "pixels of another size": (*binary({**PIXELS_1, "shape": [1, 3, 224, 224]},
                                           bytes(3 * 224 * 224 * 4)), f"[N, 3, {CROP}, {CROP}]"),
        "pixels of two dimensions": (*as_json({"inputs": [{**PIXELS_1, "shape": [1, 3],
                                                           "data": [1, 2, 3]}]}), "shape"),
        "pixels short": (*binary(PIXELS_1, bytes(100)), "binary data has 100"),
        "pixels with NaN": (*binary(PIXELS_1, nan.tobytes()), "NaN"),
        "pixels with infinity in JSON": (*as_json({"inputs": [{**PIXELS_1,
                                                               "data": inf.ravel().tolist()}]}),
                                         "infinite"),
        "pixels as strings": (*as_json({"inputs": [{**PIXELS_1,
                                                    "data": ["1"] * (3 * CROP * CROP)}]}),
                              "numbers"),
        "pixels ragged": (*as_json({"inputs": [{**PIXELS_1, "data": [[1, 2], [3]]}]}),
                          "regular"),
        "too many images": (*as_json({"inputs": [image_input(MAX_IMAGES + 1)]}),
                            f"1 to {MAX_IMAGES}"),
        "no images": (*as_json({"inputs": [{**image_input(), "shape": [0], "data": []}]}),
                      f"1 to {MAX_IMAGES}"),
        "fewer strings than the shape": (*as_json({"inputs": [{**image_input(2),
                                                               "shape": [3]}]}), "3 base64"),
        "not base64": (*as_json({"inputs": [{**image_input(), "data": ["%%%"]}]}), "base64"),
        "unknown output": (*as_json({"inputs": [image_input()],
                                     "outputs": [{"name": "LOGITS"}]}), "LOGITS"),
        "output twice": (*as_json({"inputs": [image_input()],
                                   "outputs": [{"name": "PROBABILITIES"}] * 2}), "twice"),
        "classification of the embedding": (*as_json({"inputs": [image_input()], "outputs": [
            {"name": "EMBEDDING", "parameters": {"classification": 2}}]}), "PROBABILITIES only"),
        "classification not a number": (*as_json({"inputs": [image_input()], "outputs": [
            {"name": "PROBABILITIES", "parameters": {"classification": "3"}}]}), "whole number"),
        "embedding of a model without features": (*as_json({"inputs": [image_input()],
                                                            "outputs": [{"name": "EMBEDDING"}]}),
                                                  "no EMBEDDING"),
        "shared memory": (*as_json({"inputs": [{**image_input(), "parameters": {
            "shared_memory_region": "r"}}]}), "shared-memory"),
        "binary flag not a boolean": (*as_json({"inputs": [image_input()],
                                                "parameters": {"binary_data_output": 1}}),
                                      "true or false"),
    }
    return cases


@pytest.mark.parametrize("case", list(malformed()))
async def test_malformed_requests_get_400_in_the_protocols_shape(app: FastAPI,
                                                                 case: str) -> None:
    content, headers, words = malformed()[case]
    async with client(app) as http:
        response = await http.post(INFER, content=content, headers=headers)
    assert words in oip_error(response, 400)
    assert state_of(app).engine.batcher.backlog == 0


async def test_a_json_part_over_its_limit_gets_413(app: FastAPI) -> None:
    body = json.dumps({"id": "x" * MAX_JSON_BYTES, "inputs": [image_input()]})
    async with client(app) as http:
        response = await http.post(INFER, content=body)
    assert "binary data" in oip_error(response, 413)


async def test_a_compressed_body_gets_415(app: FastAPI) -> None:
    async with client(app) as http:
        response = await http.post(INFER, content=b"\x1f\x8b...",
                                   headers={"Content-Encoding": "gzip"})
    assert "uncompressed" in oip_error(response, 415)


async def test_an_unknown_model_or_version_gets_404(app: FastAPI) -> None:
    async with client(app) as http:
        unknown = await http.post("/v2/models/..%2F..%2Fetc%2Fpasswd/infer",
                                  json={"inputs": [image_input()]})
        missing = await http.post("/v2/models/no_such_model/infer",
                                  json={"inputs": [image_input()]})
        version = await http.post(f"/v2/models/{MODEL}/versions/7/infer",
                                  json={"inputs": [image_input()]})
        path = await http.get("/v2/nowhere")
    oip_error(unknown, 404)
    assert "no_such_model" in oip_error(missing, 404)
    assert "version" in oip_error(version, 404)
    oip_error(path, 404)


# --- the gates -----------------------------------------------------------------------------


def test_infer_is_in_the_classify_family() -> None:
    assert route_family("POST", INFER) == "classify"
    assert route_family("POST", f"/v2/models/{MODEL}/versions/1/infer") == "classify"
    assert route_family("GET", f"/v2/models/{MODEL}") == "read"


async def test_gate_refusals_on_v2_have_the_protocols_shape(tmp_path: Path) -> None:
    with built_app(tmp_path, ready=True, classify_burst=1, classify_per_s=0.001,
                   max_body_bytes="1KiB") as app:
        async with client(app) as http:
            host = await http.get("/v2/health/live", headers={"Host": "evil.example"})
            v1_host = await http.get("/v1/stats", headers={"Host": "evil.example"})
            large = await http.post(INFER, content=bytes(2048))
            limited = await http.post(INFER, json={"inputs": [image_input()]})
            v1_limited = await http.post("/v1/classify", content=png(),
                                         headers={"Content-Type": "image/png"})
            stats = (await http.get("/v1/stats")).json()
    assert "address" in oip_error(host, 403)
    error_message(v1_host, 403, "forbidden")
    assert "limit" in oip_error(large, 413)
    assert "Too many requests" in oip_error(limited, 429)
    assert limited.headers["Retry-After"] and limited.headers["RateLimit-Limit"] == "1"
    error_message(v1_limited, 429, "rate_limited")  # one classify bucket for both
    assert stats["requests"]["rate_limited"] == 2
    assert stats["requests"]["forbidden"] == 2


# --- the parser, fuzzed -------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=20)
TENSORS = st.fixed_dictionaries({
    "name": st.sampled_from(["IMAGE", "PIXELS"]) | JSON_VALUES,
    "datatype": st.sampled_from(["BYTES", "FP32"]) | JSON_VALUES,
    "shape": st.lists(st.integers(-2, 5), max_size=5) | JSON_VALUES,
    "data": st.lists(st.floats() | st.integers() | st.text(max_size=8), max_size=60)
    | JSON_VALUES,
    "parameters": st.fixed_dictionaries({}, optional={
        "binary_data_size": st.integers(-1, 400) | JSON_VALUES})})


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(inputs=st.lists(TENSORS, max_size=2) | JSON_VALUES,
       outputs=st.none() | st.lists(st.fixed_dictionaries(
           {"name": st.sampled_from(["PROBABILITIES", "EMBEDDING"]) | JSON_VALUES,
            "parameters": JSON_VALUES})) | JSON_VALUES,
       tail=st.binary(max_size=400), header=st.none() | st.integers(-5, 2000).map(str)
       | st.text(max_size=6))
def test_the_parser_answers_any_body_with_a_client_error_or_a_request(
        inputs: object, outputs: object, tail: bytes, header: str | None) -> None:
    """Whatever the body and the header length: parsed, or 400/413, never anything else."""
    head = json.dumps({"inputs": inputs, "outputs": outputs}).encode()
    body = head + tail
    for length in (header, str(len(head))):
        try:
            parsed = parse_request(body, length, 2)
        except ApiError as error:
            assert error.status in (400, 413)
            continue
        assert 1 <= parsed.count <= MAX_IMAGES
        if parsed.pixels is not None:
            assert parsed.pixels.shape[1:] == (3, 2, 2)
            assert np.isfinite(parsed.pixels).all()


ELEMENTS = st.lists(st.binary(min_size=1, max_size=8), max_size=4)


def expected_error(elements: list[bytes], count: int, stray: bytes, short: bool) -> str | None:
    """What ``unpack_bytes`` must say of ``count`` elements read from ``elements`` packed,
    then ``stray`` (0-3 bytes), or with the last element a byte short; None: parsed."""
    read = min(count, len(elements))
    if count > len(elements):
        if short:
            last = len(elements) - 1
            return (f"element {last} says it has {len(elements[last])} bytes, but only "
                    f"{len(elements[last]) - 1} are left")
        return f"ends before the length of element {len(elements)} ({count} expected)"
    left = sum(4 + len(e) for e in elements[read:]) + len(stray) - short
    if short and read == len(elements):
        return (f"element {read - 1} says it has {len(elements[-1])} bytes, but only "
                f"{len(elements[-1]) - 1} are left")
    if left:
        return f"{left} bytes are left after its {count} elements"
    return None


@settings(max_examples=300, deadline=None)
@given(elements=ELEMENTS, count=st.integers(1, 5), stray=st.binary(max_size=3),
       short=st.booleans())
def test_a_tail_of_valid_lengths_and_stray_bytes_gets_the_exact_400(
        elements: list[bytes], count: int, stray: bytes, short: bool) -> None:
    """A BYTES tensor's tail built from valid length prefixes, then 0-3 stray bytes or its
    last element a byte short, with ``binary_data_size`` its length (the fuzz above draws
    the two apart, so they almost never agree): each count parsed or refused with the
    exact 400, never a struct.error (a 500) or a negative count of bytes left."""
    short = short and bool(elements)
    tail = pack_bytes(elements)[:-1] if short else pack_bytes(elements) + stray
    stray = b"" if short else stray
    body, headers = binary_request({**ONE_IMAGE, "shape": [count]}, tail)
    wanted = expected_error(elements, count, stray, short)
    try:
        parsed = parse_request(body, headers[HEADER_LENGTH], 2)
    except ApiError as error:
        assert error.status == 400 and wanted is not None and wanted in error.message, (
            error.message, wanted)
    else:
        assert wanted is None, wanted
        assert parsed.images == elements
