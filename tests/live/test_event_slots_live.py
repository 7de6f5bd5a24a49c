"""The live-view slots on a real server over real sockets: one program rotating
``X-Client-Id``s (the tray's and none among them) takes every slot open to it, and the
tray (the admin token) and the dashboard (its session) still get their streams; the tray
as it runs (its controller, the real client, the server's token file) proves the server
and sends its token, so its stream is accepted. Bounded: 44 sockets, closed at the end.
In process: ``tests/inprocess/test_event_slots.py``; the dashboard page itself:
``tests/desktop/test_dashboard_live_view.py``."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

from live_server import LiveServer, live_server
from tray_follow import CountingClient, assert_no_stream_left, follow_until, polls

from app.http.live_feed import KEPT, MAX_STREAMS_PER_CLIENT, MAX_SUBSCRIBERS
from tray.controller import TrayController

OPEN_TO_ANYONE = MAX_SUBSCRIBERS - len(KEPT)


def open_stream(server: LiveServer, headers: dict[str, str],
                held: list[socket.socket]) -> int:
    """GET /v1/events on a new socket, kept open in ``held``; the answer's status."""
    port = int(server.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    held.append(sock)
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    sock.sendall(f"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{lines}\r\n".encode())
    head = b""
    while b"\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, head
        head += chunk
    return int(head.split(b" ", 2)[1])


@contextlib.contextmanager
def sockets() -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    try:
        yield held
    finally:
        for sock in held:
            sock.close()


def session_of(server: LiveServer) -> dict[str, str]:
    """What the dashboard opened from the tray holds: a session for its Bearer header."""
    with server.client() as http:
        code = http.post("/v1/admin/ui-link", headers=server.admin()).json()["code"]
        redeemed = http.post("/v1/ui/session", json={"code": code})
    assert redeemed.status_code == 200, redeemed.text
    return {"Authorization": f"Bearer {redeemed.json()['token']}"}


def test_rotating_ids_take_every_open_slot_and_the_tray_and_dashboard_get_theirs(
        tmp_path: Path) -> None:
    with live_server(tmp_path, "--no-cache") as server:
        session = session_of(server)
        claims = [{"X-Client-Id": "vramguard-tray"}, {}] * MAX_STREAMS_PER_CLIENT
        claims += [{"X-Client-Id": f"id-{i}"} for i in range(40 - len(claims))]
        with sockets() as held:
            flood = [open_stream(server, claim, held) for claim in claims]
            tray = open_stream(server, {"X-Client-Id": "vramguard-tray", **server.admin()},
                               held)
            dashboard = open_stream(server, session, held)
            late = open_stream(server, {"X-Client-Id": "id-late"}, held)
    assert flood.count(200) == OPEN_TO_ANYONE and flood.count(503) == 40 - OPEN_TO_ANYONE
    assert tray == 200 and dashboard == 200 and late == 503


def test_the_trays_own_stream_is_accepted_with_every_open_slot_taken(tmp_path: Path) -> None:
    """Refused, the tray would poll instead (``polls``); accepted, samples come over the
    stream (``news``) and it never polls."""
    with live_server(tmp_path, "--no-cache") as server, sockets() as held:
        flood = [open_stream(server, {"X-Client-Id": f"id-{i}"}, held)
                 for i in range(OPEN_TO_ANYONE + 2)]
        assert flood.count(200) == OPEN_TO_ANYONE  # nothing open is left
        said: list[str] = []
        tray = TrayController(CountingClient(server.url, server.token_file), said.append)
        tray.follow()
        try:
            woken = follow_until(tray, lambda news: news >= 2 or polls(tray) > 0, 20)
        finally:
            tray.stop_following()
            tray.client.close()
    assert_no_stream_left()
    assert polls(tray) == 0 and woken >= 2 and tray.status == "running"
