"""POST /v1/classify/stream on real servers: 200 images with broken ones each get one line,
memory stays flat from 10 to 1,000 images, and a client that hangs up halfway leaves
nothing queued (the in-process stream tests are in ``tests/inprocess/test_stream.py``)."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from asgi import png
from images import encode
from live_server import live_server
from PIL import Image
from stream_body import END, HEADERS, broken_images, by_index, lines, part

from app.api.stream import PATH


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
