"""POST /v1/classify/stream: framing (NDJSON, Server-Sent Events), one line per image with
/v1/classify's answer or error, per-image and whole-body limits, backpressure, pauses that
are not stalls, a token per image; in process over httpx's ASGITransport. Then (slow) real
servers: 200 images with broken ones, memory flat from 10 to 1,000 images, and a client
that hangs up halfway."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
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
from images import encode, photo
from live_server import live_server
from PIL import Image

from app.api.stream import PATH
from app.engine.batcher import Reservation
from app.engine.predictor import Prediction, Sample
from app.gates.rate_limit import STREAM_ROUTES

BOUNDARY = "vramguard-stream-test"
HEADERS = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
END = f"--{BOUNDARY}--\r\n".encode()
SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect/></svg>'


def part(data: bytes, filename: str, field: str = "file") -> bytes:
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{field}\"; "
            f"filename=\"{filename}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
            ).encode() + data + b"\r\n"


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
async def test_other_fields_are_skipped_and_a_body_without_images_is_refused(
        tmp_path: Path) -> None:
    with built_app(tmp_path, ready=True) as app:
        async with client(app) as http:
            mixed = await http.post(PATH, headers=HEADERS, content=part(b"hi", "n.txt", "note")
                                    + part(png(), "a.png") + END)
            nothing = await http.post(PATH, headers=HEADERS,
                                      content=part(b"hi", "n.txt", "note") + END)
            raw = await http.post(PATH, content=png(), headers={"Content-Type": "image/png"})
            garbled = await http.post(PATH, headers=HEADERS, content=b"no boundary here")
    found = lines(mixed)
    assert [line["filename"] for line in found[:-1]] == ["a.png"]
    error_message(nothing, 400, "bad_request")
    error_message(raw, 415, "unsupported_media_type")
    error_message(garbled, 400, "bad_request")


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
    """A burst of 3 at 20/s: 8 images wait for 5 tokens (about 0.25 s), none is refused,
    and the client's bucket is empty afterwards, as after 8 single requests."""
    images = [(f"{i}.png", png()) for i in range(8)]
    with built_app(tmp_path, ready=True, classify_burst=3, classify_per_s=20) as app:
        async with client(app) as http:
            started = time.monotonic()
            response = await http.post(PATH, content=chunks(images), headers=HEADERS)
            took = time.monotonic() - started
            single = await http.post("/v1/classify", content=png(),
                                     headers={"Content-Type": "image/png"})
            stats = (await http.get("/v1/stats")).json()
    assert lines(response)[-1]["summary"]["ok"] == 8
    assert took >= 0.2
    assert single.status_code == 429
    assert stats["rate_limited"] == 1  # the single request; the stream's waits are not


def test_the_stream_route_is_an_image_route() -> None:
    assert {PATH} == STREAM_ROUTES


# --- real servers (slow) -----------------------------------------------------------------


def jpeg_photos(count: int, side: int = 256) -> Iterator[bytes]:
    """``count`` distinct noisy JPEGs (noise does not compress: 64 KB at 256 pixels a
    side, 100 KB at 320)."""
    rng = np.random.default_rng(7)
    base = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
    for i in range(count):
        pixels = base.copy()
        pixels[i % side, :, :] = i % 256
        yield encode(Image.fromarray(pixels), "JPEG", quality=92)


def upload(images: Iterable[tuple[str, bytes]]) -> Iterator[bytes]:
    for name, data in images:
        yield part(data, name)
    yield END


def stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/stats", timeout=30).json()


def peak_rss_since_reset(pid: int, run: Any) -> int:
    """How far the server's peak resident memory rose above its level when ``run`` began
    (the kernel's high-water mark, reset first through /proc/<pid>/clear_refs)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = _status(pid, "VmRSS")
    run()
    return _status(pid, "VmHWM") - before


def _status(pid: int, key: str) -> int:
    found = re.search(rf"^{key}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    assert found is not None
    return int(found.group(1)) * 1024


@pytest.mark.slow
def test_200_images_with_broken_ones_each_get_one_line(server: Any) -> None:
    broken = broken_images()
    good = list(jpeg_photos(190))
    images = [(f"{i}.jpg", data) for i, data in enumerate(good)]
    for offset, (name, data) in enumerate(broken.items()):
        images.insert(offset * 40, (name, data))
    images += [(f"extra-{i}.png", png()) for i in range(200 - len(images))]
    with httpx.Client(base_url=server.url, timeout=120) as http:
        response = http.post(PATH, content=upload(images), headers=HEADERS)
        alone = {name: http.post("/v1/classify", files={"file": (name, data)})
                 for name, data in broken.items()}
    found = lines(response)
    answered = by_index(found[:-1])
    assert sorted(answered) == list(range(200))
    for index, (name, _) in enumerate(images):
        assert answered[index]["filename"] == name
        if name in broken:
            assert answered[index]["error"] == alone[name].json()["error"], name
        else:
            assert answered[index]["result"]["predictions"], name
    assert found[-1]["summary"] == {**found[-1]["summary"], "images": 200,
                                    "failed": len(broken)}


@pytest.mark.slow
def test_memory_stays_flat_from_10_to_1000_images(tmp_path: Path) -> None:
    """The server's peak memory during a 1,000-image stream (about 100 MB of JPEGs, sent
    as fast as the server reads) rises at most 50 MiB more than during a 10-image one.
    Peaks are the kernel's high-water mark, reset before each run; both runs follow a
    warm-up stream, on one server."""
    photos = list(jpeg_photos(50, side=320))
    assert sum(map(len, photos)) * 20 > 95 * 1024**2

    def run(count: int) -> None:
        images = ((f"{i}.jpg", photos[i % len(photos)]) for i in range(count))
        with httpx.Client(base_url=running.url, timeout=600) as http:
            found = lines(http.post(PATH, content=upload(images), headers=HEADERS))
        assert found[-1]["summary"] == {**found[-1]["summary"], "images": count, "ok": count}

    with live_server(tmp_path, "--no-cache", "--batch-size", "4",
                     env={"VRAMGUARD_RATE_LIMIT": "0"}) as running:
        pid = running.process.pid
        run(20)
        small = peak_rss_since_reset(pid, lambda: run(10))
        large = peak_rss_since_reset(pid, lambda: run(1000))
    print(f"peak rise: 10 images {small / 2**20:.1f} MiB, 1000 images {large / 2**20:.1f} MiB")
    assert large - small <= 50 * 1024**2


@pytest.mark.slow
def test_a_client_that_hangs_up_halfway_leaves_nothing_queued(server: Any) -> None:
    """Send 400 images, read 20 answers, close the socket: the server stops reading, and
    what it had queued is withdrawn, not computed."""
    total = 400
    photos = list(jpeg_photos(20))
    before = stats(server.url)
    host, port = httpx.URL(server.url).host, httpx.URL(server.url).port
    with socket.create_connection((host, port)) as sock:
        head = (f"POST {PATH} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Content-Type: {HEADERS['Content-Type']}\r\n"
                "Transfer-Encoding: chunked\r\n\r\n").encode()
        sock.sendall(head)
        sock.settimeout(60)
        received = b""
        sent = 0
        sock.setblocking(False)
        while received.count(b'{"index":') < 20:
            if sent < total:
                data = part(photos[sent % len(photos)], f"{sent}.jpg")
                try:
                    sock.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    sent += 1
                except BlockingIOError:  # the server is not reading: it has no room
                    pass
            try:
                received += sock.recv(65536)
            except BlockingIOError:
                time.sleep(0.01)
    deadline = time.monotonic() + 30
    while True:
        after = stats(server.url)
        if after["queue_depth"] == 0 and after["in_flight"] == 0:
            break
        assert time.monotonic() < deadline, after
        time.sleep(0.2)
    time.sleep(1)
    after = stats(server.url)
    computed = after["batched_images"] - before["batched_images"]
    print(f"sent {sent} of {total} parts; computed {computed}; "
          f"withdrawn {after['withdrawn_in_queue'] - before['withdrawn_in_queue']}")
    assert computed < total // 2
    assert after["requests"].get("client_closed", 0) > before["requests"].get("client_closed", 0)
