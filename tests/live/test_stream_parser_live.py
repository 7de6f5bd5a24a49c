"""What the image stream's parser costs everyone, on a real server over real sockets: an
endless part header is refused past python-multipart's 4 KiB limit, and parts that are
not images end the body at the first one, while ``/healthz`` stays fast for everyone
(before: +16 MiB of memory per 20 MiB of header, parsed byte by byte in the event loop,
``/healthz`` 1.2 to 1.7 s; two streams of skipped parts, a median of 758 ms). Bounded: two
attackers for ``ATTACK_S``, each connection at most ``MAX_SENT`` bytes."""

from __future__ import annotations

import select
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from asgi import png
from live_server import LiveServer, live_server
from stream_body import BOUNDARY, part

from app.api.stream import PATH

ATTACKERS = 2
ATTACK_S = 3.0
MAX_SENT = 4 * 1024**2  # per connection; an old parser would take all of it
CHUNK = 64 * 1024
ANSWER_S = 6.0  # an attacking connection is answered within this (2.05-4.1 s beside 2 CPU hogs)
HEALTHZ_S = 0.5  # the slowest /healthz while they attack (a busy test machine: slack)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    env = {"VRAMGUARD_RATE_LIMIT": "0"}
    with live_server(tmp_path_factory.mktemp("parser"), "--no-cache", env=env) as running:
        yield running


def attack(server: LiveServer, first: bytes, more: bytes) -> tuple[bytes, float]:
    """One connection: a stream's head, ``first``, then ``more`` again and again until the
    server answers (at most ``MAX_SENT``); its answer, and the seconds it took to begin."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                     f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
                     f"Content-Length: {MAX_SENT + len(first)}\r\n\r\n".encode() + first)
        started, sent = time.monotonic(), 0
        while sent < MAX_SENT:
            readable, writable, _ = select.select([sock], [sock], [], 1)
            if readable:
                break
            if writable:
                sent += sock.send(more)
        answer = read_answer(sock)
        return answer, time.monotonic() - started


def read_answer(sock: socket.socket) -> bytes:
    """The answer: its head, then its Content-Length, or up to its last chunk."""
    sock.settimeout(ANSWER_S * 2)
    data = b""
    while b"\r\n\r\n" not in data or not answered(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def answered(data: bytes) -> bool:
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return body.endswith(b"0\r\n\r\n")  # the last chunk of a chunked answer


def under_attack(server: LiveServer, one: Callable[[], tuple[bytes, float]]
                 ) -> tuple[list[tuple[bytes, float]], list[float]]:
    """``ATTACKERS`` threads repeating ``one`` for ``ATTACK_S``; meanwhile /healthz is
    asked every 20 ms. Every attack's outcome, and each /healthz's seconds."""
    outcomes: list[tuple[bytes, float]] = []
    stop = threading.Event()

    def attacker() -> None:
        while not stop.is_set():
            outcomes.append(one())
            stop.wait(0.05)  # a few connections a second each, not a busy loop

    threads = [threading.Thread(target=attacker) for _ in range(ATTACKERS)]
    for thread in threads:
        thread.start()
    seconds: list[float] = []
    try:
        with server.client() as http:
            end = time.monotonic() + ATTACK_S
            while time.monotonic() < end:
                started = time.monotonic()
                assert http.get("/healthz").status_code == 200
                seconds.append(time.monotonic() - started)
                time.sleep(0.02)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    return outcomes, seconds


def test_an_endless_part_header_is_refused_and_healthz_stays_fast(server: LiveServer) -> None:
    start = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
             "filename=\"").encode()
    outcomes, healthz = under_attack(server, lambda: attack(server, start, b"a" * CHUNK))
    assert outcomes
    for answer, seconds in outcomes:
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
        assert b"header size" in answer
        assert seconds < ANSWER_S, seconds
    assert max(healthz) < HEALTHZ_S, (statistics.median(healthz), max(healthz))


def test_parts_that_are_not_images_end_the_body_and_healthz_stays_fast(
        server: LiveServer) -> None:
    note = part(b"x", "n.txt", "note")
    junk = note * (CHUNK // len(note))
    outcomes, healthz = under_attack(server, lambda: attack(server, part(png(), "a.png"),
                                                            junk))
    assert outcomes
    for answer, seconds in outcomes:
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        assert b'"result"' in answer and b"Only images" in answer
        assert b'"summary":{"images":1,' in answer
        assert seconds < ANSWER_S, seconds
    assert max(healthz) < HEALTHZ_S, (statistics.median(healthz), max(healthz))
