"""The image stream's request body and answer, for its tests: multipart parts in the field
``file``, the NDJSON lines read back, and images that fail to decode."""

from __future__ import annotations

import json
from typing import Any

import httpx
import numpy as np
from images import photo

BOUNDARY = "vramguard-stream-test"
HEADERS = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
END = f"--{BOUNDARY}--\r\n".encode()
SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect/></svg>'


def part(data: bytes, filename: str, field: str = "file") -> bytes:
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{field}\"; "
            f"filename=\"{filename}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
            ).encode() + data + b"\r\n"


def lines(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/x-ndjson"
    return [json.loads(line) for line in response.text.splitlines()]


def broken_images() -> dict[str, bytes]:
    jpeg = photo()
    return {"truncated.jpg": jpeg[:len(jpeg) // 3],
            "noise.jpg": np.random.default_rng(1).bytes(5000),
            "drawing.svg": SVG,
            "empty.png": b""}


def by_index(found: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    images = [line for line in found if "index" in line]
    indices = [line["index"] for line in images]
    assert len(indices) == len(set(indices)), "an image got more than one line"
    return {line["index"]: line for line in images}
