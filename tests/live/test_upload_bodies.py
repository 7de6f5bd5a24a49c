"""Upload bodies on a real server over real sockets: uploads declared and never sent hold
nothing, a stalled one gets 408 and a closed connection, clients that hang up mid-upload
are counted, not logged as failures, and trickled uploads are cut at their whole-body
deadline while an upload above the minimum rate is served."""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from images import encode, photo
from live_server import LiveServer, live_server
from PIL import Image

JPEG = {"Content-Type": "image/jpeg"}
MIB = 1024**2


def declare(server: LiveServer, length: int) -> socket.socket:
    """A socket that sent the head of an upload of ``length`` bytes and none of its body.
    ``Expect: 100-continue`` makes the server say when the route starts reading it."""
    port = int(server.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                 b"Content-Type: image/jpeg\r\nContent-Length: %d\r\n"
                 b"Expect: 100-continue\r\n\r\n" % (port, length))
    assert read_all(sock, until=b"\r\n\r\n").startswith(b"HTTP/1.1 100 ")
    return sock


def read_all(sock: socket.socket, until: bytes | None = None) -> bytes:
    """What the server sends, up to ``until`` or else until it closes the connection."""
    data = b""
    while until is None or until not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def requests(server: LiveServer) -> dict[str, int]:
    with server.client(headers={"X-Client-Id": "test-monitor"}) as client:
        counts: dict[str, int] = client.get("/v1/stats").json()["requests"]
    return counts


def test_idle_uploads_hold_nothing_stalls_close_and_hang_ups_are_counted(tmp_path: Path) -> None:
    with live_server(tmp_path, "--no-cache") as running:
        stalled = declare(running, MIB)  # 1000 bytes, then nothing: 408 after the timeout
        stalled.sendall(bytes(1000))
        idle = [declare(running, 32 * MIB) for _ in range(4)]  # the whole in-flight budget
        try:
            with running.client() as client:
                answer = client.post("/v1/classify", content=photo(), headers=JPEG)
            assert answer.status_code == 200, answer.text
        finally:
            for sock in idle:
                sock.close()
        half = declare(running, MIB)
        half.sendall(bytes(300_000))
        half.close()
        with stalled:
            answer_bytes = read_all(stalled)  # the server closes the connection after it
        assert answer_bytes.startswith(b"HTTP/1.1 408 ")
        assert b"connection: close" in answer_bytes.lower()
        assert b'"request_timeout"' in answer_bytes
        deadline = time.monotonic() + 30
        while requests(running).get("client_closed", 0) < 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert requests(running) == {"ok": 1, "client_closed": 5, "request_timeout": 1}
    log = running.log_text()
    assert "Traceback" not in log and "unexpected error" not in log


GRACE_S = 2
MIN_RATE = 128 * 1024  # bytes a second: the test's minimum, a tenth of the default's
SLACK_S = 4  # on top of a deadline: a busy machine, the server's timer resolution
REQUEST_TIMEOUT_S = 4  # less than the 6.4 s the served slow upload below takes


@pytest.fixture(scope="module")
def paced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server with a 2-place line, a short grace and a low minimum rate (so that a body
    at that rate takes seconds, not minutes), and a request timeout shorter than a slow
    upload takes: it counts from the body's arrival, so a slow upload is still answered."""
    env = {"VRAMGUARD_QUEUE_SIZE": "2", "VRAMGUARD_UPLOAD_GRACE_S": str(GRACE_S),
           "VRAMGUARD_MIN_UPLOAD_BYTES_PER_S": str(MIN_RATE),
           "VRAMGUARD_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S), "VRAMGUARD_RATE_LIMIT": "0"}
    with live_server(tmp_path_factory.mktemp("paced"), "--no-cache", env=env) as server:
        yield server


def start_upload(server: LiveServer, path: str, length: int,
                 content_type: bytes = b"image/jpeg", *, close: bool = False
                 ) -> tuple[socket.socket, bytes]:
    """A socket that sent the head of an upload of ``length`` bytes to ``path`` (``close``:
    asking for the connection to be closed after the answer); and the server's first
    answer: ``100 Continue`` once the route reads the body (it has its place in line), or
    its refusal."""
    port = int(server.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: %s\r\n"
                 b"Content-Length: %d\r\nExpect: 100-continue\r\n%s\r\n"
                 % (path.encode(), port, content_type, length,
                    b"Connection: close\r\n" if close else b""))
    return sock, read_all(sock, until=b"\r\n\r\n")


def trickle(socks: list[socket.socket], limit_s: float) -> dict[socket.socket, float]:
    """Send each socket one byte a second until the server answers it; the seconds each
    waited for its answer (the ones not answered within ``limit_s`` are missing)."""
    started, answered = time.monotonic(), {}
    while len(answered) < len(socks) and time.monotonic() - started < limit_s:
        for sock in socks:
            if sock not in answered:
                with contextlib.suppress(OSError):
                    sock.sendall(b"x")
        readable, _, _ = select.select([s for s in socks if s not in answered], [], [], 1)
        for sock in readable:
            answered[sock] = time.monotonic() - started
    return answered


def test_trickled_uploads_are_cut_at_their_deadline_while_others_are_served(paced):
    """The attack of issue 26: uploads sending a byte a second held every place in line.
    Six of them against a 2-place line (/v2 included): two get their places, four get 503
    at once; the two are cut with 408 within the grace, and meanwhile /healthz answers;
    then another client's image is served."""
    uploads = [start_upload(paced, "/v1/classify", 1000) for _ in range(4)]
    uploads += [start_upload(paced, "/v2/models/efficientnet_lite0/infer", 1000,
                             b"application/json") for _ in range(2)]
    placed = [sock for sock, first in uploads if first.startswith(b"HTTP/1.1 100 ")]
    refused = [first for _, first in uploads if first.startswith(b"HTTP/1.1 503 ")]
    try:
        assert (len(placed), len(refused)) == (2, 4), [first[:12] for _, first in uploads]
        with paced.client() as client:
            assert client.get("/healthz").status_code == 200
        answered = trickle(placed, GRACE_S + SLACK_S)
        assert len(answered) == 2, "a trickled upload was not cut within its deadline"
        assert all(waited >= GRACE_S - 1 for waited in answered.values()), answered
        for sock in placed:
            answer = read_all(sock)  # and the server closes the connection
            assert answer.startswith(b"HTTP/1.1 408 ") and b"too slowly" in answer
            assert b"connection: close" in answer.lower()
        with paced.client() as client:
            image = client.post("/v1/classify", content=photo(), headers=JPEG)
        assert image.status_code == 200, image.text
    finally:
        for sock, _ in uploads:
            sock.close()


def noise_png(side: int) -> bytes:
    """A real image that does not compress: about 3 bytes a pixel."""
    pixels = np.random.default_rng(26).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return encode(Image.fromarray(pixels), "PNG")


def send_at(server: LiveServer, body: bytes, bytes_per_s: float) -> tuple[bytes, float]:
    """POST ``body`` to /v1/classify in 16 KiB chunks at ``bytes_per_s``; the answer and
    the seconds it took."""
    sock, first = start_upload(server, "/v1/classify", len(body), b"image/png", close=True)
    assert first.startswith(b"HTTP/1.1 100 "), first
    chunk, started = 16 * 1024, time.monotonic()
    with sock:
        for offset in range(0, len(body), chunk):
            time.sleep(max(0.0, started + offset / bytes_per_s - time.monotonic()))
            sock.sendall(body[offset:offset + chunk])
            if select.select([sock], [], [], 0)[0]:  # answered before the end: cut
                break
        return read_all(sock), time.monotonic() - started


def test_an_upload_just_above_the_minimum_rate_is_served_and_one_below_is_cut(paced):
    """A real client's upload at 1.25 times the minimum rate takes three times the grace
    and is answered; at half the rate it is cut once its waits pass the grace plus what
    its bytes bought (2 s / (1 - 0.5) = 4 s in). The default rate is ten times this one,
    and a 32 MiB upload at it is the same test at 32 times the size."""
    body = noise_png(600)
    assert len(body) > 1024**2 - 100_000
    answer, took_s = send_at(paced, body, 1.25 * MIN_RATE)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert took_s > 3 * GRACE_S > REQUEST_TIMEOUT_S  # the upload's time is not the request's
    answer, took_s = send_at(paced, body, 0.5 * MIN_RATE)
    assert answer.startswith(b"HTTP/1.1 408 ") and b"too slowly" in answer, answer[:300]
    assert 2 * GRACE_S - 1 <= took_s <= 2 * GRACE_S + SLACK_S
