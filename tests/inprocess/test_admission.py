"""Admission before the upload, in process: a request whose answer could not come in time
is refused before a byte of its image is read, and images waiting for the model give
their upload bytes back once decoded, so the upload budget serves the next uploads."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from asgi import (
    PEER,
    PORT,
    ReadyEngine,
    built_app,
    client,
    state_of,
    until,
)
from images import photo

from app.engine.predictor import Prediction, Sample

pytestmark = pytest.mark.anyio
JPEG = {"Content-Type": "image/jpeg"}


async def post_counting_reads(app: Any, body: bytes) -> tuple[int, dict[bytes, bytes], int]:
    """POST ``body`` to /v1/classify through the ASGI interface; return the status, the
    answer's headers and how many body messages the app asked for."""
    reads = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        if reads == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # the client stays connected until answered
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/classify",
             "raw_path": b"/v1/classify", "query_string": b"", "root_path": "",
             "headers": [(b"host", f"127.0.0.1:{PORT}".encode()),
                         (b"content-type", b"image/jpeg"),
                         (b"content-length", str(len(body)).encode())],
             "client": PEER, "server": ("127.0.0.1", PORT), "state": {}}
    await asyncio.wait_for(app(scope, receive, send), 10)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], dict(start["headers"]), reads


async def test_a_request_that_could_not_be_answered_in_time_is_refused_unread(
        tmp_path: Path) -> None:
    with built_app(tmp_path, ready=True) as app:
        state_of(app).engine.batcher.set_service_rate(0.05)  # 20 s per image > 10 s deadline
        status, headers, reads = await post_counting_reads(app, photo())
        assert status == 503 and b"retry-after" in headers
        assert reads == 0  # the upload was never asked for, so it was never read
        state_of(app).engine.batcher.set_service_rate(100.0)
        status, _, reads = await post_counting_reads(app, photo())
        assert status == 200 and reads >= 1


async def test_decoded_images_waiting_for_the_model_give_their_upload_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    image = photo()
    budget = len(image) * 3 // 2  # room for one upload in flight, not two
    with built_app(tmp_path, ready=True, rate_limit=False, max_inflight_body_bytes=budget,
                   max_inflight_body_bytes_per_client=budget) as app:
        engine = state_of(app).engine
        assert isinstance(engine, ReadyEngine)
        model_free = asyncio.Event()
        waiting: list[Sample] = []
        answer = ReadyEngine.classify

        async def busy_model(sample: Sample, timeout_s: float, *args: Any) -> Prediction:
            waiting.append(sample)
            await model_free.wait()
            return await answer(engine, sample, timeout_s)

        monkeypatch.setattr(engine, "classify", busy_model)
        async with client(app) as http:
            first = asyncio.ensure_future(http.post("/v1/classify", content=image,
                                                    headers=JPEG))
            await until(lambda: len(waiting) == 1)  # read, decoded, waiting for the model
            second = asyncio.ensure_future(http.post("/v1/classify", content=image,
                                                     headers=JPEG))
            await until(lambda: len(waiting) == 2 or second.done())
            model_free.set()
            answers = await asyncio.gather(first, second)
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
