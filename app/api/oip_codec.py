"""Inference requests and answers of the Open Inference Protocol, in JSON and in Triton's
binary tensor extension: a JSON header, then each tensor's raw bytes, the header's length
in the ``Inference-Header-Content-Length`` HTTP header, each tensor's in its
``binary_data_size`` parameter; a BYTES tensor's elements each prefixed by their length
(4 bytes, little-endian).

The body comes from anyone on this computer, so every length is checked against the
bytes actually there before anything is sliced, nothing is allocated from a length
a client states, and the JSON part is bounded (``MAX_JSON_BYTES``) below the body limit:
parsed JSON takes several times its size in memory.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.errors import BadRequest, PayloadTooLarge
from app.units import human_bytes

MAX_IMAGES = 64  # images in one request; each still takes its own place in line
MAX_JSON_BYTES = 8 * 1024**2  # the JSON part; binary tensors are bounded by max_body_bytes
HEADER_LENGTH = "Inference-Header-Content-Length"
IMAGE, PIXELS = "IMAGE", "PIXELS"  # inputs: encoded image files, or the model's input
PROBABILITIES, EMBEDDING = "PROBABILITIES", "EMBEDDING"
BYTES, FP32 = "BYTES", "FP32"
CHANNELS = 3
_LENGTH = struct.Struct("<I")


@dataclass(frozen=True)
class Requested:
    """An output the request asks for; ``classes`` > 0 asks for Triton's classification
    extension instead of the tensor: the top ``classes`` as "score:index:label" strings."""

    name: str
    classes: int
    binary: bool


@dataclass
class InferRequest:
    """A parsed request: its images (IMAGE) or their pixels (PIXELS, [N, 3, H, W]), and
    what it wants back. ``images`` is a list so that each can be dropped once decoded."""

    id: str | None
    input_name: str
    images: list[bytes]
    pixels: np.ndarray | None
    outputs: list[Requested]

    @property
    def count(self) -> int:
        return len(self.images) if self.pixels is None else len(self.pixels)


@dataclass(frozen=True)
class Tensor:
    """An output: FP32 values (any shape, sent row-major) or BYTES elements (strings)."""

    name: str
    shape: list[int]
    values: np.ndarray | list[str]
    binary: bool

    @property
    def datatype(self) -> str:
        return FP32 if isinstance(self.values, np.ndarray) else BYTES


def pack_bytes(items: list[bytes]) -> bytes:
    """A BYTES tensor's binary form: each element after its length (4 bytes, little-endian)."""
    return b"".join(part for item in items for part in (_LENGTH.pack(len(item)), item))


def unpack_bytes(raw: bytes | memoryview, count: int, name: str) -> list[bytes]:
    """Exactly ``count`` length-prefixed elements filling ``raw``; every length is checked
    against what is left before anything is copied."""
    view, items, offset = memoryview(raw), [], 0
    for index in range(count):
        if len(view) - offset < _LENGTH.size:
            raise BadRequest(f"{name}: its binary data ends before the length of element "
                             f"{index} ({count} expected).")
        (size,) = _LENGTH.unpack_from(view, offset)
        offset += _LENGTH.size
        if size > len(view) - offset:
            raise BadRequest(f"{name}: element {index} says it has {size} bytes, but only "
                             f"{len(view) - offset} are left in its binary data.")
        items.append(bytes(view[offset:offset + size]))
        offset += size
    if offset != len(view):
        raise BadRequest(f"{name}: {len(view) - offset} bytes are left after its {count} "
                         "elements; the shape and the binary data disagree.")
    return items


def parse_request(body: bytes, header_length: str | None, crop: int,
                  channels: int = CHANNELS, output: str = PROBABILITIES) -> InferRequest:
    """The request in ``body`` for a model whose input is ``crop`` x ``crop`` and whose own
    output, answered when the request names none, is ``output``; BadRequest (400) for
    anything malformed, PayloadTooLarge (413) for a JSON part over the limit."""
    view = memoryview(body)
    json_end = _json_length(header_length, len(view))
    head = _load_json(view[:json_end])
    request_id = head.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest("The request's \"id\" must be a string.")
    binary_default = _flag(_parameters(head, "the request"), "binary_data_output", False)
    inputs = head.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise BadRequest(f"Send exactly one input: {IMAGE} (BYTES [N], encoded image files) "
                         f"or {PIXELS} (FP32 [N, {channels}, {crop}, {crop}], preprocessed).")
    tensor: dict[str, Any] = inputs[0]
    name = tensor.get("name")
    if name not in (IMAGE, PIXELS):
        raise BadRequest(f"Unknown input {name!r:.40}: send {IMAGE} (encoded image files) or "
                         f"{PIXELS} (preprocessed pixels).")
    raw = _binary_part(tensor, view[json_end:], header_length is not None, name)
    images: list[bytes] = []
    pixels = None
    if name == IMAGE:
        images = _images(tensor, raw)
    else:
        pixels = _pixels(tensor, raw, crop, channels)
    return InferRequest(request_id, name, images, pixels,
                        _outputs(head.get("outputs"), binary_default, output))


def _json_length(header_length: str | None, size: int) -> int:
    """Where the JSON part ends: the whole body, or the header's figure, checked."""
    if header_length is None:
        end = size
    else:
        value = header_length.strip()
        if not (value.isascii() and value.isdigit()) or len(value) > 12:
            raise BadRequest(f"{HEADER_LENGTH} must be a number of bytes, not {value[:20]!r}.")
        end = int(value)
        if end > size:
            raise BadRequest(f"{HEADER_LENGTH} says the JSON part has {end} bytes, but the "
                             f"body has only {size}.")
    if end > MAX_JSON_BYTES:
        raise PayloadTooLarge(f"The JSON part of the request is larger than the "
                              f"{human_bytes(MAX_JSON_BYTES)} limit. Send tensors as binary "
                              "data (binary_data_size, as tritonclient does by default).")
    return end


def _load_json(part: memoryview) -> dict[str, Any]:
    try:
        head = json.loads(bytes(part).decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise BadRequest(f"The request is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(head, dict):
        raise BadRequest("The request must be a JSON object with \"inputs\".")
    return head


def _parameters(holder: dict[str, Any], what: str) -> dict[str, Any]:
    found = holder.get("parameters", {})
    if not isinstance(found, dict):
        raise BadRequest(f"The parameters of {what} must be a JSON object.")
    if "shared_memory_region" in found:
        raise BadRequest("The shared-memory extension is not supported: send the data in "
                         "the request.")
    return found


def _flag(parameters: dict[str, Any], key: str, default: bool) -> bool:
    value = parameters.get(key, default)
    if not isinstance(value, bool):
        raise BadRequest(f"The parameter {key} must be true or false.")
    return value


def _integer(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRequest(f"{what} must be a whole number of at least 0, not {value!r:.40}.")
    return value


def _binary_part(tensor: dict[str, Any], rest: memoryview, has_header: bool,
                 name: str) -> memoryview | None:
    """The input's binary data (all that follows the JSON part), or None when its data is
    in the JSON; the two must agree to the byte."""
    size = _parameters(tensor, f"input {name}").get("binary_data_size")
    if size is None:
        if len(rest):
            raise BadRequest(f"{len(rest)} bytes follow the JSON part, but the input has no "
                             "binary_data_size.")
        return None
    size = _integer(size, f"{name}'s binary_data_size")
    if not has_header:
        raise BadRequest(f"{name} has binary_data_size but the request has no {HEADER_LENGTH} "
                         "header to say where its JSON part ends.")
    if size != len(rest):
        raise BadRequest(f"{name}'s binary_data_size is {size} bytes, but {len(rest)} follow "
                         "the JSON part.")
    return rest


def _batch(tensor: dict[str, Any], dims: int, expected: str) -> list[int]:
    """The input's shape, ``dims`` long, its first dimension the batch (1..MAX_IMAGES)."""
    shape = tensor.get("shape")
    if (not isinstance(shape, list) or len(shape) != dims
            or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):
        raise BadRequest(f"{tensor.get('name')}'s shape must be {expected}, not {shape!r:.80}.")
    if not 1 <= shape[0] <= MAX_IMAGES:
        raise BadRequest(f"{tensor.get('name')} holds {shape[0]} images; send 1 to "
                         f"{MAX_IMAGES} per request.")
    return shape


def _datatype(tensor: dict[str, Any], wanted: str, hint: str) -> None:
    if tensor.get("datatype") != wanted:
        raise BadRequest(f"{tensor.get('name')} is {wanted}, not {tensor.get('datatype')!r:.20}"
                         f"; {hint}")


def _images(tensor: dict[str, Any], raw: memoryview | None) -> list[bytes]:
    """Encoded image files: binary elements, or base64 strings in JSON (an image file is
    not text, and JSON carries only text)."""
    _datatype(tensor, BYTES, f"for preprocessed pixels send {PIXELS} (FP32).")
    (count,) = _batch(tensor, 1, "[N]")
    if raw is not None:
        return unpack_bytes(raw, count, IMAGE)
    data = tensor.get("data")
    if not isinstance(data, list) or len(data) != count:
        raise BadRequest(f"{IMAGE} has shape [{count}]: send {count} base64 strings in its "
                         "\"data\", or the files as binary data.")
    images = []
    for index, item in enumerate(data):
        try:
            images.append(base64.b64decode(item, validate=True))
        except (TypeError, ValueError, binascii.Error):
            raise BadRequest(f"{IMAGE}[{index}] is not a base64 string; in JSON an image "
                             "file is sent base64-encoded.") from None
    return images


def _pixels(tensor: dict[str, Any], raw: memoryview | None, crop: int, channels: int
            ) -> np.ndarray:
    """[N, channels, crop, crop] float32, finite: the model's own input, so only that
    shape (three channels, or one for a grey model)."""
    expected = f"[N, {channels}, {crop}, {crop}] for this model"
    _datatype(tensor, FP32, f"for encoded image files send {IMAGE} (BYTES).")
    shape = _batch(tensor, 4, expected)
    if shape[1:] != [channels, crop, crop]:
        raise BadRequest(f"{PIXELS}'s shape must be {expected}, not {shape}.")
    size = shape[0] * channels * crop * crop
    if raw is not None:
        if len(raw) != size * 4:
            raise BadRequest(f"{PIXELS} of shape {shape} is {size * 4} bytes of FP32, but its "
                             f"binary data has {len(raw)}.")
        values = np.frombuffer(raw, dtype="<f4").astype(np.float32)  # a copy: the body goes
    else:
        values = _numbers(tensor.get("data"), size, shape)
    if not np.isfinite(values).all():
        raise BadRequest(f"{PIXELS} holds NaN or infinite values.")
    return values.reshape(shape)


def _numbers(data: object, size: int, shape: list[int]) -> np.ndarray:
    """JSON numbers, flat or nested, row-major, as float32."""
    if not isinstance(data, list):
        raise BadRequest(f"{PIXELS} needs its values in \"data\", or as binary data.")
    try:
        values = np.asarray(data)
    except (ValueError, TypeError, OverflowError, RecursionError):
        raise BadRequest(f"{PIXELS}'s \"data\" is not a regular array of numbers.") from None
    if values.dtype.kind not in "iuf":
        raise BadRequest(f"{PIXELS}'s \"data\" must hold only numbers.")
    if values.size != size:
        raise BadRequest(f"{PIXELS} of shape {shape} has {size} values, but its \"data\" "
                         f"holds {values.size}.")
    with np.errstate(over="ignore"):  # too large for float32: infinite, refused after
        return values.astype(np.float32).ravel()


def _outputs(outputs: object, binary_default: bool, default: str) -> list[Requested]:
    """What to answer: the outputs named, in their order; the model's own when none is."""
    if outputs is None:
        return [Requested(default, 0, binary_default)]
    if not isinstance(outputs, list) or not outputs:
        raise BadRequest("\"outputs\" must be a list of the outputs wanted.")
    wanted: list[Requested] = []
    for each in outputs:
        name = each.get("name") if isinstance(each, dict) else None
        if name not in (PROBABILITIES, EMBEDDING):
            raise BadRequest(f"Unknown output {name!r:.40}: ask for {PROBABILITIES} or "
                             f"{EMBEDDING}.")
        if any(w.name == name for w in wanted):
            raise BadRequest(f"The output {name} is asked for twice.")
        parameters = _parameters(each, f"output {name}")
        classes = _integer(parameters.get("classification", 0), "classification")
        if classes and name != PROBABILITIES:
            raise BadRequest(f"classification applies to {PROBABILITIES} only.")
        wanted.append(Requested(name, classes,
                                _flag(parameters, "binary_data", binary_default)))
    return wanted


def encode_response(model: str, version: str, request_id: str | None,
                    tensors: list[Tensor]) -> tuple[bytes, int | None]:
    """The answer's body, and the length of its JSON part when binary data follows it
    (for the ``Inference-Header-Content-Length`` header; None: all JSON)."""
    head: dict[str, Any] = {"model_name": model, "model_version": version}
    if request_id is not None:
        head["id"] = request_id
    described, blobs = [], []
    for tensor in tensors:
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype,
                                 "shape": tensor.shape}
        values = tensor.values
        if tensor.binary:
            blob = (np.ascontiguousarray(values, dtype="<f4").tobytes()
                    if isinstance(values, np.ndarray)
                    else pack_bytes([v.encode() for v in values]))
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = values.ravel().tolist() if isinstance(values, np.ndarray) else values
        described.append(entry)
    head["outputs"] = described
    text = json.dumps(head, separators=(",", ":")).encode()
    if not blobs:
        return text, None
    return b"".join([text, *blobs]), len(text)
