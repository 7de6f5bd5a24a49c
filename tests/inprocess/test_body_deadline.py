"""The whole-body deadline and the small allowance, in process: a trickled body is cut
within its grace plus what its bytes bought (408, connection closed, its bytes and its
place in line given back), a body at more than the minimum rate is read however long it
takes, and a route that takes no upload reads at most a kilobyte."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from asgi import built_app, client, error_message, state_of
from images import photo
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.errors import ApiError
from app.gates.body_limit import BodySizeLimit
from app.gates.upload_deadline import UploadPace
from app.http.stats import RequestStats

pytestmark = pytest.mark.anyio
RATE = 1000  # bytes a second, the minimum in these tests
GRACE_S = 0.5
SLACK_S = 1.0  # on top of a deadline: a busy machine
JPEG = {"Content-Type": "image/jpeg"}


class Trickle:
    """A request body of ``count`` chunks of ``size`` bytes, one every ``every_s``."""

    def __init__(self, count: int, size: int, every_s: float) -> None:
        self.count, self.size, self.every_s = count, size, every_s

    @property
    def length(self) -> int:
        return self.count * self.size

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for _ in range(self.count):
            yield b"x" * self.size
            await asyncio.sleep(self.every_s)


async def read(request: Request) -> Response:
    return JSONResponse({"bytes": len(await request.body())})


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


def paced_gate() -> BodySizeLimit:
    return BodySizeLimit(Starlette(routes=[Route("/v1/classify", read, methods=["POST"])],
                                   exception_handlers={ApiError: api_error}),
                         max_bytes=100_000, max_inflight_bytes=200_000,
                         max_client_bytes=200_000, read_timeout_s=5, stats=RequestStats(),
                         pace=UploadPace(RATE, GRACE_S))


async def test_a_trickled_body_is_cut_at_its_deadline_and_gives_back_its_bytes() -> None:
    """200 bytes a second, each chunk well inside the no-progress timeout: cut when the
    waits pass 0.5 s + received / 1000, about 0.63 s in."""
    gate = paced_gate()
    body = Trickle(count=100, size=10, every_s=0.05)
    started = time.monotonic()
    async with client(gate) as http:
        response = await asyncio.wait_for(http.post(
            "/v1/classify", content=body, headers={"Content-Length": str(body.length)}), 5)
    took_s = time.monotonic() - started
    assert "arrived too slowly" in error_message(response, 408, "request_timeout")
    assert response.headers["Connection"] == "close"
    assert GRACE_S <= took_s < GRACE_S + SLACK_S
    assert gate.inflight == 0 and gate.by_client == {}


async def test_a_body_above_the_minimum_rate_is_read_whole_past_the_grace() -> None:
    """2000 bytes a second for about 1.5 s: three times the grace, never cut."""
    body = Trickle(count=30, size=100, every_s=0.05)
    async with client(paced_gate()) as http:
        response = await asyncio.wait_for(http.post(
            "/v1/classify", content=body, headers={"Content-Length": str(body.length)}), 10)
    assert response.status_code == 200, response.text
    assert response.json() == {"bytes": body.length}


async def test_a_route_that_takes_no_upload_reads_at_most_a_kilobyte(tmp_path: Path) -> None:
    with built_app(tmp_path) as app:
        async with client(app) as http:
            nonce = await http.post("/v1/identity", json={"nonce": "ab" * 32})
            padded = await http.post("/v1/identity", content=b" " * 2048,
                                     headers={"Content-Type": "application/json"})
            pause = await http.post("/v1/admin/pause", content=b"x" * 2048)
    assert nonce.status_code == 200, nonce.text
    assert "at most 1 KiB" in error_message(padded, 413, "payload_too_large")
    error_message(pause, 413, "payload_too_large")  # before the token is even looked at


async def test_a_trickled_identity_challenge_is_cut_within_its_grace(tmp_path: Path) -> None:
    """The route anyone may call: a nonce sent a byte every 0.1 s gets 408 after about
    the grace (not a 400: FastAPI reads that body, and its failure is unwrapped)."""
    body = Trickle(count=77, size=1, every_s=0.1)
    with built_app(tmp_path, upload_grace_s=GRACE_S) as app:
        started = time.monotonic()
        async with client(app) as http:
            response = await asyncio.wait_for(http.post(
                "/v1/identity", content=body, headers={
                    "Content-Type": "application/json",
                    "Content-Length": str(body.length)}), 5)
    assert time.monotonic() - started < GRACE_S + SLACK_S
    assert "arrived too slowly" in error_message(response, 408, "request_timeout")
    assert response.headers["Connection"] == "close"


async def test_trickled_uploads_give_back_their_places_in_line(tmp_path: Path) -> None:
    """Two trickles hold a 2-place line, so a real image gets 503; once they are cut, at
    their deadline, the next image is served."""
    with built_app(tmp_path, ready=True, queue_size=2, upload_grace_s=GRACE_S) as app:
        async with client(app) as http:
            trickles = [asyncio.ensure_future(http.post(
                "/v1/classify", content=Trickle(1000, 1, 0.1), headers={
                    **JPEG, "Content-Length": "1000", "X-Client-Id": f"trickle-{n}"}))
                for n in range(2)]
            await asyncio.sleep(GRACE_S / 2)
            during = await http.post("/v1/classify", content=photo(), headers=JPEG)
            cut = await asyncio.wait_for(asyncio.gather(*trickles), GRACE_S + SLACK_S)
            after = await http.post("/v1/classify", content=photo(), headers=JPEG)
    error_message(during, 503, "overloaded")
    for response in cut:
        assert "arrived too slowly" in error_message(response, 408, "request_timeout")
    assert after.status_code == 200, after.text
    assert state_of(app).stats.snapshot()["request_timeout"] == 2
