"""POST /v1/classify/stream: framing (NDJSON, Server-Sent Events), one line per image with
/v1/classify's answer or error, per-image and whole-body limits, backpressure, pauses that
are not stalls, a token per image; in process over httpx's ASGITransport. The real
servers' stream tests are in ``tests/live/test_stream_servers.py``."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from asgi import (  # noqa: F401  (anyio_backend is a fixture)
    LABELS,
    ReadyEngine,
    anyio_backend,
    built_app,
    client,
    error_message,
    png,
    state_of,
)
from images import encode
from PIL import Image
from stream_body import END, HEADERS, broken_images, by_index, lines, part

from app.api.stream import PATH
from app.engine.lanes import Reservation
from app.engine.predictor import Prediction, Sample
from app.http.scope import STREAM_ROUTES


def body(images: Iterable[tuple[str, bytes]]) -> bytes:
    return b"".join(part(data, name) for name, data in images) + END


async def chunks(images: Iterable[tuple[str, bytes]]) -> AsyncIterator[bytes]:
    """The body one part per chunk, as the server asks for it."""
    for name, data in images:
        yield part(data, name)
    yield END


def noisy_png(side: int = 20, seed: int = 0) -> bytes:
    """A PNG that does not compress: about side x side x 3 bytes."""
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return encode(Image.fromarray(pixels), "PNG")


class SlowEngine(ReadyEngine):
    """The stand-in engine taking ``delay_s`` per image; it records how many images were
    in its hands at once."""

    delay_s = 0.05

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.busy = self.most_busy = 0

    async def classify(self, sample: Sample, timeout_s: float,
                       reservation: Reservation | None = None,
                       model: str | None = None) -> Prediction:
        self.busy += 1
        self.most_busy = max(self.most_busy, self.busy)
        try:
            await asyncio.sleep(self.delay_s)
            return await super().classify(sample, timeout_s, reservation, model)
        finally:
            self.busy -= 1


def with_engine(app: Any, engine: ReadyEngine) -> None:
    state_of(app).engine = engine


# --- framing -----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_every_image_gets_one_line_with_what_classify_would_answer(
        tmp_path: Path) -> None:
    images = {"a.png": png(), **broken_images(), "b.png": png(12)}
    with built_app(tmp_path, ready=True) as app:
        async with client(app) as http:
            response = await http.post(PATH, content=body(images.items()), headers=HEADERS,
                                       params={"top_k": 3})
            alone = {name: await http.post("/v1/classify", files={"file": (name, data)},
                                           params={"top_k": 3})
                     for name, data in images.items()}
    found = lines(response)
    assert found[-1]["summary"]["images"] == len(images)
    assert found[-1]["summary"]["ok"] == 2 and found[-1]["summary"]["failed"] == 4
    answered = by_index(found[:-1])
    assert sorted(answered) == list(range(len(images)))
    for index, (name, _) in enumerate(images.items()):
        line, single = answered[index], alone[name]
        assert line["filename"] == name
        if single.status_code == 200:
            expected = single.json()
            assert set(line["result"]) == set(expected)
            assert line["result"]["predictions"] == expected["predictions"]
            assert [p["label"] for p in expected["predictions"]] == LABELS[::-1][:3]
        else:
            assert line["error"] == single.json()["error"], name


@pytest.mark.anyio
async def test_server_sent_events_when_the_client_asks(tmp_path: Path) -> None:
    with built_app(tmp_path, ready=True) as app:
        async with client(app) as http:
            response = await http.post(PATH, content=body([("a.png", png()), ("b", b"x")]),
                                       headers={**HEADERS, "Accept": "text/event-stream"})
    assert response.headers["content-type"] == "text/event-stream"
    events = response.text.split("\n\n")
    assert events[-1] == ""
    parsed = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert all(event.startswith("data: {") for event in events[:-1])
    assert sorted(line["index"] for line in parsed if "index" in line) == [0, 1]
    assert "summary" in parsed[-1]


@pytest.mark.anyio
async def test_a_field_that_is_not_an_image_ends_the_body_and_no_image_is_refused(
        tmp_path: Path) -> None:
    """A part not named 'file' would cost no token and no place in line: it is refused at
    its headers, first (a plain 400) or after images (the body's error line)."""
    note = part(b"hi" * 10_000, "n.txt", "note")
    with built_app(tmp_path, ready=True) as app:
        async with client(app) as http:
            first = await http.post(PATH, headers=HEADERS, content=note + part(png(), "a.png")
                                    + END)
            later = await http.post(PATH, headers=HEADERS, content=part(png(), "a.png") + note
                                    + part(png(), "b.png") + END)
            empty = await http.post(PATH, headers=HEADERS, content=END)
            raw = await http.post(PATH, content=png(), headers={"Content-Type": "image/png"})
            garbled = await http.post(PATH, headers=HEADERS, content=b"no boundary here")
        held = state_of(app).engine.batcher.backlog
    assert "Only images" in error_message(first, 400, "bad_request")
    found = lines(later)
    assert [line.get("filename") for line in found[:-2]] == ["a.png"]
    assert "result" in found[0]
    assert found[-2]["error"]["code"] == "bad_request"
    assert "Only images" in found[-2]["error"]["message"]
    assert found[-1]["summary"]["images"] == 1  # b.png was never read
    assert "no image" in error_message(empty, 400, "bad_request")
    error_message(raw, 415, "unsupported_media_type")
    error_message(garbled, 400, "bad_request")
    assert held == 0


# --- limits ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_image_over_max_body_bytes_fails_alone(tmp_path: Path) -> None:
    big = b"\xff" * 3000
    images = [("small.png", png()), ("big.jpg", big), ("after.png", png())]
    with built_app(tmp_path, ready=True, max_body_bytes="2KiB") as app:
        async with client(app) as http:
            response = await http.post(PATH, content=body(images), headers=HEADERS)
    answered = by_index(lines(response)[:-1])
    assert answered[1]["error"]["code"] == "payload_too_large"
    assert "result" in answered[0] and "result" in answered[2]


@pytest.mark.anyio
async def test_the_whole_body_is_held_to_max_stream_bytes(tmp_path: Path) -> None:
    """Declared: 413 before a byte is read. Sent without a length: the images before the
    limit are answered, the one it cut is told so, then the stream's own error."""
    images = [(f"{i}.png", png(16)) for i in range(8)]
    limit = len(body(images[:3])) + 100
    with built_app(tmp_path, ready=True, max_stream_bytes=limit) as app:
        async with client(app) as http:
            declared = await http.post(PATH, content=body(images), headers=HEADERS)
            streamed = await http.post(PATH, content=chunks(images), headers=HEADERS)
    assert "max_stream_bytes" in error_message(declared, 413, "payload_too_large")
    found = lines(streamed)
    assert found[-2]["error"]["code"] == "payload_too_large"
    answered = by_index(found[:-2])
    # The chunk that passed the limit was not read: it held the boundary that would have
    # ended image 2, which is told the stream's error.
    assert sorted(answered) == [0, 1, 2]
    assert "result" in answered[0] and "result" in answered[1]
    assert answered[2]["error"]["code"] == "payload_too_large"


@pytest.mark.anyio
async def test_bytes_are_given_back_as_images_are_done(tmp_path: Path) -> None:
    """20 images of 1.2 KiB through a 4 KiB in-flight cap: the stream holds only what it
    has in progress (waiting for its own images to give bytes back when a part does not
    fit), so none is refused for want of upload room."""
    images = [(f"{i}.png", noisy_png(20, i)) for i in range(20)]
    assert all(len(data) > 1200 for _, data in images)
    with built_app(tmp_path, ready=True, max_inflight_body_bytes="4KiB",
                   max_inflight_body_bytes_per_client="4KiB") as app:
        async with client(app) as http:
            response = await http.post(PATH, content=chunks(images), headers=HEADERS)
            after = await http.post("/v1/classify", content=png(),
                                    headers={"Content-Type": "image/png"})
    found = lines(response)
    assert found[-1]["summary"] == {**found[-1]["summary"], "ok": 20, "failed": 0}
    assert after.status_code == 200


# --- pacing ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_next_part_is_read_only_when_there_is_room(tmp_path: Path) -> None:
    """A body of 30 parts pulled as the server reads it: never more than the window (2 x
    the batch size of 1) images taken and not yet answered, plus the one being read."""
    pulled, answered_at_pull = [], []
    with built_app(tmp_path, ready=True) as app:
        engine = SlowEngine(state_of(app).settings)
        with_engine(app, engine)

        async def parts() -> AsyncIterator[bytes]:
            for i in range(30):
                pulled.append(i)
                answered_at_pull.append(len(engine.samples))
                yield part(png(), f"{i}.png")
            yield END

        async with client(app) as http:
            response = await http.post(PATH, content=parts(), headers=HEADERS)
    assert len(by_index(lines(response)[:-1])) == 30
    ahead = [i - done for i, done in zip(pulled, answered_at_pull, strict=True)]
    assert max(ahead) <= 3, ahead
    assert engine.most_busy <= 2


@pytest.mark.anyio
async def test_pauses_for_room_are_not_stalls_but_a_client_stall_is(tmp_path: Path) -> None:
    """Each image takes 0.3 s with room for 2: the route stops reading for longer than the
    0.2 s no-progress timeout and still reads every part. A client that sends nothing for
    0.2 s while the route waits for it is cut off: the image it was sending gets 408, then
    the stream's own error line."""

    async def stalling() -> AsyncIterator[bytes]:
        yield part(png(), "0.png")
        half = part(noisy_png(), "1.png")  # its first half holds the part's headers
        yield half[:len(half) // 2]
        await asyncio.sleep(1.0)
        yield half[len(half) // 2:] + END

    with built_app(tmp_path, ready=True, body_read_timeout_s=0.2) as app:
        engine = SlowEngine(state_of(app).settings)
        engine.delay_s = 0.3
        with_engine(app, engine)
        async with client(app) as http:
            started = time.monotonic()
            patient = await http.post(PATH, headers=HEADERS,
                                      content=chunks((f"{i}.png", png()) for i in range(6)))
            took = time.monotonic() - started
            stalled = await http.post(PATH, content=stalling(), headers=HEADERS)
    found = lines(patient)
    assert took > 0.7 and found[-1]["summary"]["ok"] == 6
    cut = lines(stalled)
    answered = by_index(cut[:-2])
    assert "result" in answered[0]
    assert answered[1]["error"]["code"] == "request_timeout"
    assert cut[-2]["error"]["code"] == "request_timeout"


@pytest.mark.anyio
async def test_each_image_costs_a_token_and_waiting_for_one_is_no_refusal(
        tmp_path: Path) -> None:
    """A burst of 3 at 5/s: 8 images wait for 5 tokens (about 1 s), none is refused, and
    the client's bucket is empty afterwards, as after 8 single requests."""
    images = [(f"{i}.png", png()) for i in range(8)]
    with built_app(tmp_path, ready=True, classify_burst=3, classify_per_s=5) as app:
        async with client(app) as http:
            started = time.monotonic()
            response = await http.post(PATH, content=chunks(images), headers=HEADERS)
            took = time.monotonic() - started
            single = await http.post("/v1/classify", content=png(),
                                     headers={"Content-Type": "image/png"})
            stats = (await http.get("/v1/stats")).json()
    assert lines(response)[-1]["summary"]["ok"] == 8
    assert took >= 0.9
    # The eighth token was taken 1 s after the start at the earliest; a new one comes
    # 0.2 s later. A test machine busy enough to delay the single request past that has
    # refilled the bucket honestly, so the refusal is asserted only when it must happen.
    if took < 1.15:
        assert single.status_code == 429
        assert stats["rate_limited"] == 1  # the single request; the stream's waits are not
    else:
        assert stats["rate_limited"] == (1 if single.status_code == 429 else 0)


def test_the_stream_route_is_an_image_route() -> None:
    assert {PATH} == STREAM_ROUTES
