"""Upload bodies on a real server over real sockets: uploads declared and never sent hold
nothing, a stalled one gets 408 and a closed connection, and clients that hang up
mid-upload are counted, not logged as failures."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from images import photo
from live_server import LiveServer, live_server

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
