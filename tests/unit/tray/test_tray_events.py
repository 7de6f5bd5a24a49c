"""The tray follows the server's event stream: the SSE parser, the back-off, a state
event that recolours at once, a silent or absent server, the admin token on the stream
only for a server that proved it knows it (against real servers:
live/test_tray_events_live.py, live/test_event_slots_live.py)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from live_server import free_port
from samples import sample
from squatter import Squatter, knowing
from tray_follow import assert_no_stream_left, follow_until, polls, stream_threads, tray_for

from app.host.token_file import load_or_create_token
from app.http.live_feed import LiveFeed
from tray.event_stream import Backoff, Event, EventStream, SseParser, deliver
from tray.icon import COLOURS

STREAM = (
    "retry: 2000\n\n"
    ": a comment, as a keep-alive\n"
    'event: state\ndata: {"state":"high","t":1.5}\n\n'
    'event: sample\r\ndata:{"a":\r\ndata: 1}\r\n\r\n'  # CRLF, no space, two data lines
    "data: plain\rid: 7\r\r"  # CR alone; no event name; a field the tray ignores
    "event: empty\n\n"  # no data: nothing to dispatch
    "retry: soon\n"  # not a number: ignored
    "data: not ended yet\n"
)
EXPECTED = [Event("state", '{"state":"high","t":1.5}'), Event("sample", '{"a":\n1}'),
            Event("message", "plain")]


def parse(chunks: list[str]) -> tuple[list[Event], SseParser]:
    parser = SseParser()
    return [event for chunk in chunks for event in parser.feed(chunk)], parser


def test_parser_is_indifferent_to_where_the_network_splits():
    for cut in range(len(STREAM) + 1):
        events, parser = parse([STREAM[:cut], STREAM[cut:]])
        assert (events, parser.retry_s) == (EXPECTED, 2.0), cut


def test_parser_one_character_at_a_time():
    events, parser = parse(list(STREAM))
    assert events == EXPECTED and parser.retry_s == 2.0
    assert parser.feed("\n") == [Event("message", "not ended yet")]


def test_backoff_grows_resets_once_accepted_and_honours_the_server():
    backoff = Backoff()
    assert [backoff.after(accepted=False) for _ in range(6)] == [1, 2, 5, 10, 10, 10]
    assert backoff.after(accepted=True, asked_s=2.0) == 2.0  # the stream's own `retry:`
    assert backoff.after(accepted=False) == 2
    assert backoff.after(accepted=False, asked_s=30) == 30  # Retry-After of a refusal


def wire(*events: tuple[str, dict[str, object]]) -> str:
    """What the server's hub writes for these events, retry line included."""
    async def scenario() -> str:
        hub = LiveFeed()
        stream = hub.stream(hub.subscribe())
        text = await anext(stream)
        for kind, data in events:
            hub.publish(kind, data)
            text += await anext(stream)
        return text

    return asyncio.run(scenario())


def test_a_state_event_recolours_and_notifies_at_once(tmp_path):
    port = free_port()
    tray, messages = tray_for(f"http://127.0.0.1:{port}", tmp_path)  # never asked
    parser = SseParser()
    text = wire(("sample", sample().model_dump(mode="json")),
                ("state", {"state": "shedding", "t": 2.0}))
    first, second = parser.feed(text)
    deliver(first, tray)
    assert tray.wait_for_news(0) and tray.tooltip().startswith("vramguard: healthy, 41%")
    assert messages == [f"vramguard is ready: 127.0.0.1:{port}"]  # the first reading
    deliver(second, tray)
    assert tray.wait_for_news(0)
    assert tray.icon(32).getpixel((16, 0)) == COLOURS["shedding"]
    assert "State: full: new images wait" in tray.lines()
    assert len(messages) == 2 and "memory is full" in messages[1]
    assert polls(tray) == 0


def test_an_unreadable_event_is_skipped(tmp_path):
    tray, _ = tray_for(f"http://127.0.0.1:{free_port()}", tmp_path)
    deliver(Event("sample", '{"state": "ok"}'), tray)
    deliver(Event("state", '{"state": "melting"}'), tray)
    assert tray.down and not tray.wait_for_news(0)


def wait_until(done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def no_stream_left() -> Iterator[None]:
    yield
    assert_no_stream_left()


def test_no_server_means_down_and_retrying_not_polling(tmp_path, no_stream_left):
    tray, _ = tray_for(f"http://127.0.0.1:{free_port()}", tmp_path)
    tray.follow()
    try:
        follow_until(tray, lambda news: news >= 2, 10)  # it tried, and tried again
        assert tray.down and tray.status == "starting" and polls(tray) == 0
    finally:
        tray.stop_following()


@contextmanager
def silent_server(sends: bytes) -> Iterator[tuple[str, list[socket.socket]]]:
    """A peer that accepts the stream, says ``sends`` and then nothing: a hung server."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            connection.recv(4096)
            connection.sendall(sends)
            accepted.append(connection)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        listener.close()
        for connection in accepted:
            connection.close()


HEADERS = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
           b"transfer-encoding: chunked\r\n\r\n")


def test_a_silent_stream_is_noticed_and_retried(tmp_path, no_stream_left):
    with silent_server(HEADERS) as (url, accepted):
        tray, _ = tray_for(url, tmp_path)
        tray.stream_sample(sample())
        assert tray.status == "running"
        stream = EventStream(url, tray, lambda: None, read_timeout_s=0.3)
        stream.start()
        try:
            wait_until(lambda: tray.down, 10)
            assert tray.status == "not answering: no news from the server for 0.3 s"
            wait_until(lambda: len(accepted) >= 2, 10)  # it came back for more
        finally:
            stream.stop()


def test_stop_ends_a_stream_that_waits_for_news(tmp_path, no_stream_left):
    retry = b"retry: 2000\n\n"
    with silent_server(HEADERS + b"%x\r\n%s\r\n" % (len(retry), retry)) as (url, accepted):
        tray, _ = tray_for(url, tmp_path)
        stream = EventStream(url, tray, lambda: None, read_timeout_s=60)
        stream.start()
        wait_until(lambda: bool(accepted), 10)
        time.sleep(0.2)  # let it block in its read
        stream.stop()
        assert not stream_threads()  # woken by stop, long before its read timeout
        assert not tray.wait_for_news(0)  # and it says nothing on its way out


def test_a_refusal_without_a_server_that_answers_means_polling(tmp_path, no_stream_left):
    refusal = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
               b"retry-after: 1\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}")
    with silent_server(refusal) as (url, _):
        tray, _ = tray_for(url, tmp_path)
        tray.follow()
        try:
            follow_until(tray, lambda news: polls(tray) >= 2, 10)
            assert tray.down  # its polls fail too: this peer only refuses
        finally:
            tray.stop_following()


def test_each_connection_sends_the_token_the_credentials_give_for_it(tmp_path, no_stream_left):
    """Asked anew before each connection: a token goes as the Bearer header, None as no
    Authorization header at all."""
    given = iter(["first-token", None, "second-token"])
    with Squatter() as peer:  # answers the stream with JSON: it ends, and is tried again
        tray, _ = tray_for(peer.url, tmp_path)
        stream = EventStream(peer.url, tray, lambda: next(given, None))
        stream.start()
        try:
            wait_until(lambda: len(peer.received) >= 3, 10)
        finally:
            stream.stop()
    sent = [r.headers.get("authorization") for r in peer.received[:3]]
    assert sent == ["Bearer first-token", None, "Bearer second-token"]
    assert peer.paths()[:3] == ["/v1/events"] * 3


def follow_once(tray, peer: Squatter) -> None:
    """Follow ``peer`` until the stream has asked it for events once."""
    tray.follow()
    try:
        wait_until(lambda: "/v1/events" in peer.paths(), 10)
    finally:
        tray.stop_following()
        tray.client.close()


def test_the_tray_sends_its_token_on_the_stream_only_to_a_server_that_proves_it(
        tmp_path, no_stream_left):
    token = load_or_create_token(tmp_path / "token")
    with Squatter(knowing(token)) as ours, Squatter() as squatter:
        for peer in (ours, squatter):
            follow_once(tray_for(peer.url, tmp_path)[0], peer)
    assert ours.paths()[:2] == ["/v1/identity", "/v1/events"]
    assert ours.received[1].headers.get("authorization") == f"Bearer {token}"
    assert squatter.paths()[:2] == ["/v1/identity", "/v1/events"]  # asked, failed the proof
    assert squatter.with_token() == []  # and the stream went without


def test_without_a_readable_token_file_the_stream_goes_without(tmp_path, no_stream_left):
    (tmp_path / "token").mkdir()  # the token file cannot be read
    with Squatter(knowing("a token the tray cannot read")) as peer:
        follow_once(tray_for(peer.url, tmp_path)[0], peer)
    assert peer.paths()[0] == "/v1/events" and peer.with_token() == []


def test_the_stream_goes_to_the_server_not_through_a_proxy_of_the_environment(
        tmp_path, monkeypatch, no_stream_left):
    """A proxy named in the environment is not asked to carry the stream: it would get the
    admin token with it."""
    token = load_or_create_token(tmp_path / "token")
    with Squatter(knowing(token)) as ours, Squatter() as proxy:
        for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.setenv(name, proxy.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        stream = EventStream(ours.url, tray_for(ours.url, tmp_path)[0], lambda: token)
        stream.start()
        try:
            wait_until(lambda: bool(ours.received or proxy.received), 10)
        finally:
            stream.stop()
    assert proxy.with_token() == [] and proxy.received == []
    assert ours.paths()[0] == "/v1/events" and ours.with_token()
