"""/v2 infer costs one classify token per image, as /v1/classify and the stream do: a
bucket of 2 serves at most 2 images however they are packed (it served 128 when a
request cost one token whatever its N), and a request within the rate waits for its
tokens instead of failing. The real app and rate limiter over ASGI; the stand-in engine
counts the images it is given."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
from asgi import built_app, client, state_of

from app.api.oip_codec import HEADER_LENGTH, MAX_IMAGES

INFER = "/v2/models/efficientnet_lite0/infer"  # the stand-in's model: crop 32
CROP = 32


def pixels(count: int, app: str) -> tuple[bytes, dict[str, str]]:
    """``count`` images of preprocessed pixels, binary (nothing to decode)."""
    raw = np.zeros((count, 3, CROP, CROP), dtype="<f4").tobytes()
    head = json.dumps({"inputs": [{"name": "PIXELS", "datatype": "FP32",
                                   "shape": [count, 3, CROP, CROP],
                                   "parameters": {"binary_data_size": len(raw)}}]}).encode()
    return head + raw, {HEADER_LENGTH: str(len(head)), "X-Client-Id": app,
                        "Content-Type": "application/octet-stream"}


def test_a_bucket_of_two_serves_at_most_two_images(tmp_path: Path) -> None:
    async def run() -> None:
        with built_app(tmp_path, ready=True, classify_burst=2, classify_per_s=0.01,
                       request_timeout_s=5) as app:
            served = state_of(app).engine.samples  # type: ignore[attr-defined]
            async with client(app) as http:
                for attempt in range(5):
                    body, headers = pixels(MAX_IMAGES, "packer")
                    answer = await http.post(INFER, content=body, headers=headers)
                    assert answer.status_code == 429, (attempt, answer.text)
                    assert int(answer.headers["Retry-After"]) >= 1
                    if attempt == 0:  # refused by the route: it names the images
                        assert f"This request holds {MAX_IMAGES} images" in answer.text
                assert served == []

                body, headers = pixels(2, "pair")
                two = await http.post(INFER, content=body, headers=headers)
                assert two.status_code == 200, two.text
                assert two.json()["outputs"][0]["shape"][0] == 2
                body, headers = pixels(1, "pair")
                assert (await http.post(INFER, content=body, headers=headers)
                        ).status_code == 429
                assert len(served) == 2

    asyncio.run(run())


def test_a_request_within_the_rate_waits_for_its_tokens(tmp_path: Path) -> None:
    async def run() -> None:
        with built_app(tmp_path, ready=True, classify_burst=2, classify_per_s=20,
                       request_timeout_s=10) as app:
            async with client(app) as http:
                body, headers = pixels(6, "steady")
                started = time.monotonic()
                answer = await http.post(INFER, content=body, headers=headers)
                took = time.monotonic() - started
                assert answer.status_code == 200, answer.text
                assert answer.json()["outputs"][0]["shape"][0] == 6
                assert took >= 4 / 20 * 0.9  # 2 in the bucket, 4 more at 20 a second
            assert len(state_of(app).engine.samples) == 6  # type: ignore[attr-defined]

    asyncio.run(run())
