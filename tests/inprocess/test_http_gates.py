"""The ASGI gates in process: body limits (each body, all and each client's in flight,
stalls), Host and Origin, and the rate limiter through the real app, with an injected
clock; every refusal counted in /v1/stats."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import suppress
from pathlib import Path

import pytest
from asgi import (
    BASE_URL,
    built_app,
    client,
    error_message,
    png,
    state_of,
    until,
)
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from app.errors import ApiError
from app.gates.body_limit import BodySizeLimit
from app.gates.host_origin import HostOriginGate
from app.http.stats import RequestStats

pytestmark = pytest.mark.anyio
LIMIT = 1000  # bytes per body
CAP = 2500  # bytes of all bodies in flight
MIB = 1024**2


class Uploads:
    """A small app behind the body gate. /read reads the body and answers its size; /hold
    reads it, then waits for ``release``; /boom reads it, then fails; /listen reads it,
    then waits for a hang-up. ApiErrors are answered as the real app does."""

    def __init__(self, client_cap: int = CAP, read_timeout_s: float = 5.0) -> None:
        self.bodies: list[int] = []  # sizes of the bodies an endpoint read in full
        self.release = asyncio.Event()
        self.stats = RequestStats()
        self.gate = BodySizeLimit(Starlette(
            routes=[Route("/read", self.read, methods=["POST"]),
                    Route("/hold", self.hold, methods=["POST"]),
                    Route("/boom", self.boom, methods=["POST"]),
                    Route("/listen", self.listen, methods=["GET", "POST"])],
            exception_handlers={ApiError: self.api_error}), max_bytes=LIMIT,
            max_inflight_bytes=CAP, max_client_bytes=client_cap,
            read_timeout_s=read_timeout_s, stats=self.stats)

    async def read(self, request: Request) -> Response:
        body = await request.body()
        self.bodies.append(len(body))
        return JSONResponse({"bytes": len(body)})

    async def hold(self, request: Request) -> Response:
        response = await self.read(request)
        await self.release.wait()
        return response

    async def boom(self, request: Request) -> Response:
        await request.body()
        raise RuntimeError("the handler failed after reading the body")

    async def listen(self, request: Request) -> Response:
        """Read the body (if any), then wait for the client to hang up for three read
        timeouts, as classify (waiting for the model) and the event stream do."""
        body = await request.body()
        with suppress(TimeoutError):
            await asyncio.wait_for(request.receive(), 3 * self.gate.read_timeout_s)
        return JSONResponse({"bytes": len(body)})

    @staticmethod
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return exc.response()


class Chunks:
    """A request body sent ``count`` chunks of ``size`` bytes; counts the chunks the
    server pulled."""

    def __init__(self, count: int, size: int) -> None:
        self.count, self.size, self.pulled = count, size, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for _ in range(self.count):
            self.pulled += 1
            yield b"x" * self.size


class Stalling:
    """A request body that sends ``first``, then nothing until ``go`` is set (an idle
    socket), then ``rest``. ``waiting`` says the server has asked for the chunk that is
    not coming."""

    def __init__(self, first: bytes = b"", rest: bytes = b"") -> None:
        self.first, self.rest = first, rest
        self.go = asyncio.Event()
        self.waiting = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.first:
            yield self.first
        self.waiting = True
        await self.go.wait()
        if self.rest:
            yield self.rest


@pytest.fixture
def uploads() -> Uploads:
    return Uploads()


@pytest.fixture
def app(tmp_path: Path) -> Iterator[FastAPI]:
    """The real app with a small read burst (3, then one token every 2 s) and one allowed
    web origin."""
    with built_app(tmp_path, read_burst=3, read_per_s=0.5,
                   cors_origins=["http://localhost:3000"]) as app:
        yield app


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- body size ------------------------------------------------------------------------


async def test_a_body_within_the_limit_passes(uploads: Uploads) -> None:
    async with client(uploads.gate) as http:
        response = await http.post("/read", content=b"x" * LIMIT)
    assert response.status_code == 200 and response.json() == {"bytes": LIMIT}
    assert uploads.gate.inflight == 0


async def test_a_declared_length_over_the_limit_is_413_and_the_endpoint_never_runs(
        uploads: Uploads) -> None:
    body = Chunks(5, 300)  # 1500 bytes: read through and dropped, so the client sees the 413
    async with client(uploads.gate) as http:
        response = await http.post("/read", content=body, headers={"Content-Length": "1500"})
    assert "larger than" in error_message(response, 413, "payload_too_large")
    assert uploads.bodies == [] and body.pulled == 5 and uploads.gate.inflight == 0


async def test_a_huge_declared_length_is_refused_without_reading_a_byte(
        uploads: Uploads) -> None:
    body = Chunks(50, 1000)  # over 4x the limit: not worth draining
    async with client(uploads.gate) as http:
        response = await http.post("/read", content=body, headers={"Content-Length": "50000"})
    error_message(response, 413, "payload_too_large")
    assert body.pulled == 0 and uploads.bodies == []


async def test_a_chunked_body_is_cut_off_as_soon_as_it_passes_the_limit(
        uploads: Uploads) -> None:
    body = Chunks(10, 300)  # no Content-Length: the 4th chunk makes 1200 > 1000
    async with client(uploads.gate) as http:
        response = await http.post("/read", content=body)
    assert response.request.headers.get("transfer-encoding") == "chunked"
    error_message(response, 413, "payload_too_large")
    assert body.pulled == 4 and uploads.bodies == [] and uploads.gate.inflight == 0


async def test_a_lying_content_length_is_cut_off_at_the_limit(uploads: Uploads) -> None:
    async with client(uploads.gate) as http:
        response = await http.post("/read", content=Chunks(10, 300),
                                   headers={"Content-Length": "10"})
    error_message(response, 413, "payload_too_large")
    assert uploads.bodies == [] and uploads.gate.inflight == 0


async def test_uploads_past_the_in_flight_cap_get_503_until_bytes_are_released(
        uploads: Uploads) -> None:
    gate = uploads.gate
    async with client(uploads.gate) as http:
        held = [asyncio.ensure_future(http.post("/hold", content=b"x" * LIMIT))
                for _ in range(2)]
        await until(lambda: len(uploads.bodies) == 2)
        assert gate.inflight == 2 * LIMIT

        refused = await http.post("/read", content=b"x" * LIMIT)  # 3000 > 2500
        assert "too many images" in error_message(refused, 503, "overloaded")
        assert refused.headers["Retry-After"] == "1"
        assert uploads.bodies == [LIMIT, LIMIT]  # refused before its endpoint ran

        fits = await http.post("/read", content=b"x" * (CAP - 2 * LIMIT))  # exactly the cap
        assert fits.status_code == 200 and gate.inflight == 2 * LIMIT

        chunked = Chunks(2, 300)  # undeclared: counted as it comes, refused at 2600
        refused = await http.post("/read", content=chunked)
        error_message(refused, 503, "overloaded")
        assert chunked.pulled == 2 and gate.inflight == 2 * LIMIT

        uploads.release.set()
        answers = await asyncio.wait_for(asyncio.gather(*held), 5)
    assert [a.status_code for a in answers] == [200, 200]
    assert gate.inflight == 0
    async with client(uploads.gate) as http:  # and the next upload of that size is fine
        assert (await http.post("/read", content=b"x" * LIMIT)).status_code == 200


async def test_in_flight_bytes_are_given_back_when_a_request_fails_or_is_cancelled(
        uploads: Uploads) -> None:
    gate = uploads.gate
    async with client(uploads.gate) as http:
        with pytest.raises(RuntimeError, match="handler failed"):
            await http.post("/boom", content=b"x" * 800)
        assert gate.inflight == 0

        waiting = asyncio.ensure_future(http.post("/hold", content=b"x" * 900))
        await until(lambda: gate.inflight == 900)
        waiting.cancel()  # the client went away while its request was held
        with pytest.raises(asyncio.CancelledError):
            await waiting
    assert gate.inflight == 0


# --- bodies as they arrive: idle, stalled, per client -----------------------------------


async def test_idle_declared_uploads_do_not_block_a_real_one(tmp_path: Path) -> None:
    """Four sockets that each declare 32 MiB (together the whole default budget of bytes
    in flight) and send nothing hold nothing: a real upload still gets through."""
    idle = [Stalling() for _ in range(4)]
    with built_app(tmp_path, ready=True) as app:
        async with client(app) as http:
            pending = [asyncio.ensure_future(http.post(
                "/v1/classify", content=body,
                headers={"Content-Type": "image/png", "Content-Length": str(32 * MIB)}))
                for body in idle]
            await until(lambda: all(body.waiting for body in idle))
            response = await http.post("/v1/classify", content=png(),
                                       headers={"Content-Type": "image/png"})
            for request in pending:
                request.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    assert response.status_code == 200, response.text


async def test_bytes_are_charged_as_they_arrive_not_as_declared(uploads: Uploads) -> None:
    gate = uploads.gate
    body = Stalling(b"x" * 300, b"x" * 700)
    async with client(gate) as http:
        sending = asyncio.ensure_future(http.post("/read", content=body,
                                                  headers={"Content-Length": "1000"}))
        await until(lambda: body.waiting)
        assert gate.inflight == 300 and gate.by_client == {"127.0.0.1": 300}
        body.go.set()
        response = await asyncio.wait_for(sending, 5)
    assert response.json() == {"bytes": 1000}
    assert gate.inflight == 0 and gate.by_client == {}


async def test_one_client_cannot_hold_the_whole_budget() -> None:
    uploads = Uploads(client_cap=1500)
    async with client(uploads.gate) as http:
        held = asyncio.ensure_future(http.post("/hold", content=b"x" * LIMIT))
        await until(lambda: uploads.bodies == [LIMIT])
        refused = await http.post("/read", content=b"x" * LIMIT)  # 2000 > 1500 for one client
        other = await http.post("/read", content=b"x" * LIMIT,  # 2000 <= 2500 for all
                                headers={"X-Client-Id": "other-app"})
        uploads.release.set()
        assert (await asyncio.wait_for(held, 5)).status_code == 200
    assert "This program" in error_message(refused, 503, "overloaded")
    assert refused.headers["Retry-After"] == "1"
    assert other.json() == {"bytes": LIMIT}
    assert uploads.gate.inflight == 0 and uploads.gate.by_client == {}


@pytest.mark.parametrize("first", [b"", b"x" * 300], ids=["nothing-sent", "part-sent"])
async def test_a_stalled_body_gets_408_and_its_connection_closed(first: bytes) -> None:
    uploads = Uploads(read_timeout_s=0.2)
    async with client(uploads.gate) as http:
        response = await asyncio.wait_for(http.post(
            "/read", content=Stalling(first), headers={"Content-Length": "1000"}), 5)
    assert "stopped arriving" in error_message(response, 408, "request_timeout")
    assert response.headers["Connection"] == "close"
    assert uploads.bodies == [] and uploads.gate.inflight == 0 and uploads.gate.by_client == {}


async def test_a_refused_body_that_stalls_still_gets_its_answer_and_is_closed() -> None:
    """A 413 is read through before it is answered; a body that stalls meanwhile ends the
    reading, not the answer."""
    uploads = Uploads(read_timeout_s=0.2)
    async with client(uploads.gate) as http:
        response = await asyncio.wait_for(http.post(
            "/read", content=Stalling(b"x" * 300), headers={"Content-Length": "1500"}), 5)
    error_message(response, 413, "payload_too_large")
    assert response.headers["Connection"] == "close"
    assert uploads.stats.snapshot() == {"payload_too_large": 1}


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_waiting_for_a_hang_up_is_not_a_stall(method: str) -> None:
    """No body (GET), or one read in full: waiting longer than the read timeout for the
    client to leave answers normally, uncharged and without closing."""
    uploads = Uploads(read_timeout_s=0.1)
    async with client(uploads.gate) as http:
        response = await asyncio.wait_for(http.request(
            method, "/listen", content=b"x" * 500 if method == "POST" else None), 5)
    assert response.status_code == 200, response.text
    assert "Connection" not in response.headers
    assert uploads.gate.inflight == 0 and uploads.stats.snapshot() == {}


async def test_a_stalled_sign_in_gets_408_even_before_the_model_is_ready(
        tmp_path: Path) -> None:
    """/v1/ui/session takes a JSON body before the model is ready; FastAPI reads it, and
    its stall is still a 408, not a 400."""
    with built_app(tmp_path, body_read_timeout_s=0.2) as app:
        async with client(app) as http:
            response = await asyncio.wait_for(http.post(
                "/v1/ui/session", content=Stalling(b'{"code": '),
                headers={"Content-Type": "application/json", "Content-Length": "40"}), 5)
    error_message(response, 408, "request_timeout")
    assert response.headers["Connection"] == "close"
    assert state_of(app).stats.snapshot() == {"request_timeout": 1}


async def test_every_gate_refusal_is_counted_in_stats(tmp_path: Path) -> None:
    """403, 429, 413 and the in-flight 503 appear in /v1/stats, each once."""
    held = Stalling(b"x" * 800)
    with built_app(tmp_path, ready=True, read_burst=1, max_body_bytes="1KiB",
                   max_inflight_body_bytes="1500") as app:
        async with client(app) as http:
            holding = asyncio.ensure_future(http.post(
                "/v1/classify", content=held,
                headers={"Content-Type": "image/png", "Content-Length": "1000"}))
            await until(lambda: held.waiting)
            answers = [
                await http.get("/healthz", headers={"Host": "evil.example"}),
                await http.get("/healthz"),
                await http.get("/healthz"),
                await http.post("/v1/classify", content=b"x" * 2048,
                                headers={"Content-Type": "image/png"}),
                await http.post("/v1/classify", content=b"x" * 800,  # 1600 > 1500 in flight
                                headers={"Content-Type": "image/png"}),
            ]
            stats = await http.get("/v1/stats", headers={"X-Client-Id": "monitor"})
            holding.cancel()
            await asyncio.gather(holding, return_exceptions=True)
    assert [a.status_code for a in answers] == [403, 200, 429, 413, 503]
    assert stats.json()["requests"] == {"forbidden": 1, "rate_limited": 1,
                                        "payload_too_large": 1, "overloaded": 1}


# --- Host and Origin --------------------------------------------------------------------


async def test_a_refused_host_never_reaches_the_app() -> None:
    calls: list[str] = []

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        calls.append(scope["path"])
        await JSONResponse({"ok": True})(scope, receive, send)

    gate = HostOriginGate(inner, port=8765, extra_hosts=[], allowed_origins=[],
                          stats=RequestStats())
    async with client(gate) as http:
        refused = await http.get("/anything", headers={"Host": "evil.example"})
        passed = await http.get("/anything")
    error_message(refused, 403, "forbidden")
    assert passed.status_code == 200 and calls == ["/anything"]


@pytest.mark.parametrize("host", [
    "evil.example", "evil.example:8765", "127.0.0.1.evil.example:8765", "127.0.0.1:9999",
    "127.0.0.1", "[::1", "::1:8765", "localhost:abc",
])
async def test_a_host_that_is_not_ours_gets_403_json(app: FastAPI, host: str) -> None:
    """DNS rebinding: the page's own name (or anything malformed) in Host is refused."""
    async with client(app) as http:
        response = await http.get("/healthz", headers={"Host": host})
    assert "not allowed" in error_message(response, 403, "forbidden")


@pytest.mark.parametrize("host", ["127.0.0.1:8765", "localhost:8765", "LocalHost:8765",
                                  "[::1]:8765"])
async def test_our_own_names_pass(app: FastAPI, host: str) -> None:
    async with client(app) as http:
        response = await http.get("/healthz", headers={"Host": host})
    assert response.status_code == 200 and response.json() == {"status": "ok"}


async def test_an_ipv6_loopback_url_works_as_is(app: FastAPI) -> None:
    """A client given http://[::1]:8765 sends Host: [::1]:8765, which must pass."""
    async with client(app, base_url="http://[::1]:8765") as http:
        response = await http.get("/healthz")
    assert response.request.headers["host"] == "[::1]:8765"
    assert response.status_code == 200


async def test_the_host_gate_runs_before_routes_and_the_rate_limiter(app: FastAPI) -> None:
    async with client(app) as http:
        shutdown = await http.post("/v1/admin/shutdown", headers={"Host": "evil.example"})
        error_message(shutdown, 403, "forbidden")  # not 401: no route was reached
        for _ in range(5):
            refused = await http.get("/healthz", headers={"Host": "evil.example"})
            assert refused.status_code == 403
        answers = [await http.get("/healthz") for _ in range(3)]  # the burst is intact
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert state_of(app).limiter.rejected == 0


@pytest.mark.parametrize("origin", ["http://evil.example", "https://evil.example", "null",
                                    "http://localhost:3001", "https://127.0.0.1:8765",
                                    "file://"])
async def test_a_foreign_origin_is_refused_even_on_a_simple_post(app: FastAPI,
                                                                 origin: str) -> None:
    async with client(app) as http:
        response = await http.post("/v1/classify", content=b"x",
                                   headers={"Origin": origin, "Content-Type": "text/plain"})
    assert "origin" in error_message(response, 403, "forbidden")
    assert "access-control-allow-origin" not in response.headers


async def test_an_allowed_origin_passes_with_cors_headers_and_a_preflight(app: FastAPI) -> None:
    origin = "http://localhost:3000"
    async with client(app) as http:
        response = await http.get("/healthz", headers={"Origin": origin})
        preflight = await http.options("/v1/classify", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        foreign = await http.options("/v1/classify", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == origin
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == origin
    assert "POST" in preflight.headers["access-control-allow-methods"]
    error_message(foreign, 403, "forbidden")


@pytest.mark.parametrize("origin", [BASE_URL, "http://localhost:8765", "http://[::1]:8765/"])
async def test_our_own_origin_passes_without_cors_headers(app: FastAPI, origin: str) -> None:
    """Our own pages (/docs) are same-origin: allowed, and given no CORS grant."""
    async with client(app) as http:
        response = await http.get("/healthz", headers={"Origin": origin})
    assert response.status_code == 200
    assert "access-control-allow-origin" not in response.headers


# --- rate limits --------------------------------------------------------------------------


async def test_after_the_burst_429_with_retry_after_and_ratelimit_headers(app: FastAPI) -> None:
    state_of(app).limiter.clock = FakeClock()
    async with client(app) as http:
        answers = [await http.get("/healthz") for _ in range(3)]
        denied = await http.get("/healthz")
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert [a.headers["RateLimit-Limit"] for a in answers] == ["3", "3", "3"]
    assert [a.headers["RateLimit-Remaining"] for a in answers] == ["2", "1", "0"]
    assert [a.headers["RateLimit-Reset"] for a in answers] == ["2", "4", "6"]
    assert "Retry-After" in error_message(denied, 429, "rate_limited")
    assert denied.headers["Retry-After"] == "2"  # one token every 2 s
    assert denied.headers["RateLimit-Limit"] == "3"
    assert denied.headers["RateLimit-Remaining"] == "0"
    assert denied.headers["RateLimit-Reset"] == "6"  # until the bucket is full again
    assert state_of(app).limiter.rejected == 1


async def test_clients_and_families_have_their_own_buckets(app: FastAPI) -> None:
    state_of(app).limiter.clock = FakeClock()
    async with client(app) as http:
        for _ in range(3):
            await http.get("/healthz")
        assert (await http.get("/healthz")).status_code == 429
        named = [await http.get("/healthz", headers={"X-Client-Id": "photo-app"})
                 for _ in range(4)]
        invalid = await http.get("/healthz", headers={"X-Client-Id": "no spaces allowed"})
        classify = await http.post("/v1/classify", content=b"x",
                                   headers={"Content-Type": "image/jpeg"})
    assert [a.status_code for a in named] == [200, 200, 200, 429]
    assert invalid.status_code == 429  # an invalid id is ignored: the peer's bucket
    error_message(classify, 503, "not_ready")  # the classify family was not limited
    async with client(app, peer=("127.0.0.2", 40000)) as other:
        assert (await other.get("/healthz")).status_code == 200


async def test_a_refused_request_costs_no_token(app: FastAPI) -> None:
    clock = FakeClock()
    state_of(app).limiter.clock = clock
    async with client(app) as http:
        for _ in range(3):
            await http.get("/healthz")
        for _ in range(20):  # an impatient client, for 1.8 s
            clock.now += 0.09
            assert (await http.get("/healthz")).status_code == 429
        clock.now = 1002.0  # 2 s after the last token was taken: one token is back
        again = await http.get("/healthz")
        assert again.status_code == 200 and again.headers["RateLimit-Remaining"] == "0"
        assert (await http.get("/healthz")).status_code == 429
        stats = await http.get("/v1/stats", headers={"X-Client-Id": "monitor"})
    assert stats.json()["rate_limited"] == 21
