"""The connection layer without a server: the refusal over the cap is a whole HTTP
response, the cap fits under the open-files limit, and Nagle's algorithm is off (against a
real server: live/test_connections.py)."""

from __future__ import annotations

import json
import socket

import h11
import pytest

from app.gates.upload_deadline import UploadPace
from app.http.connections import connection_cap, overloaded_response

PACE = UploadPace(1024**2, 5.0)  # the settings' defaults


def test_the_refusal_is_a_whole_http_response_with_the_api_error_body():
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("Host", "127.0.0.1")]))
    conn.receive_data(overloaded_response())
    response, data, end = conn.next_event(), conn.next_event(), conn.next_event()
    assert isinstance(response, h11.Response) and response.status_code == 503
    headers = {name.decode(): value.decode() for name, value in response.headers}
    assert headers["retry-after"] == "1" and headers["connection"] == "close"
    assert headers["content-type"] == "application/json"
    assert json.loads(data.data)["error"]["code"] == "overloaded"
    assert isinstance(end, h11.EndOfMessage)


@pytest.mark.parametrize(("wanted", "open_files", "cap"), [
    (1024, None, 1024),     # Windows: no open-files limit
    (1024, 20000, 1024),
    (1024, 1024, 768),      # a quarter kept for files and refusals
    (1024, 256, 192),       # at least 64 kept
    (1024, 16, 8),          # never below a handful
    (4, 256, 4),
])
def test_the_cap_fits_under_the_open_files_limit(wanted, open_files, cap):
    assert connection_cap(wanted, open_files) == cap


def test_every_connection_has_nagle_off_however_it_was_accepted():
    """With Nagle's algorithm on, each small answer waits for the client's delayed ACK
    (40 ms on Linux): /healthz went from under 1 ms to 44 ms. It is turned off when the
    protocol gets the connection, so also where our listener's accept() is never called
    (Windows' Proactor loop uses AcceptEx): here uvicorn serves a plain socket, and the
    server's side of each connection is read from uvicorn's own list of them."""
    import threading
    import time

    import uvicorn

    from app.http.connections import connection_limits, guarded_protocol
    from app.http.stats import RequestStats

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    plain = socket.create_server(("127.0.0.1", 0))  # not listening_socket's _Listener
    config = uvicorn.Config(app, loop="asyncio", log_config=None, lifespan="off",
                            http=guarded_protocol(connection_limits(64, 10, PACE, 32 * 1024**2),
                                                  RequestStats()))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [plain]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with socket.create_connection(plain.getsockname()[:2]) as client:
            client.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert client.recv(4096).startswith(b"HTTP/1.1 200")
            [protocol] = server.server_state.connections
            sock = protocol.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        server.should_exit = True
        thread.join(20)
        plain.close()
