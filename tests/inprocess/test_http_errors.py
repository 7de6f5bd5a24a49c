"""Every failure as ``{"error": {"code", "message"}}`` with its documented status, through
the real app in process: before warmup, and with a stand-in engine that is ready."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from asgi import (
    LABELS,
    PEER,
    PORT,
    ReadyEngine,
    built_app,
    client,
    error_message,
    parse,
    png,
    state_of,
    value,
)
from fastapi import FastAPI
from starlette.types import Message

pytestmark = pytest.mark.anyio
PNG = {"Content-Type": "image/png"}


@pytest.fixture
def app(tmp_path: Path) -> Iterator[FastAPI]:
    """The real app before warmup (the model is never loaded)."""
    with built_app(tmp_path) as app:
        yield app


@pytest.fixture
def ready_app(tmp_path: Path) -> Iterator[FastAPI]:
    """The real app whose engine says it is ready (a stand-in model; uploads up to 4 KiB)."""
    with built_app(tmp_path, ready=True, max_body_bytes="4KiB") as app:
        yield app


@pytest.mark.parametrize(("method", "url", "status", "code", "in_message"), [
    ("GET", "/nope", 404, "not_found", "/nope"),
    ("GET", "/v1/classify", 405, "method_not_allowed", "GET"),
    ("DELETE", "/v1/stats", 405, "method_not_allowed", "DELETE"),
    ("POST", "/v1/classify?top_k=0", 400, "bad_request", "top_k"),
    ("POST", "/v1/classify?top_k=1001", 400, "bad_request", "top_k"),
    ("POST", "/v1/classify?top_k=many", 400, "bad_request", "top_k"),
    ("POST", "/v1/classify?model=resnet50", 404, "not_found", "resnet50"),
])
async def test_errors_that_need_no_model(app: FastAPI, method: str, url: str, status: int,
                                         code: str, in_message: str) -> None:
    """Routing and validation answer before the engine is asked anything."""
    async with client(app) as http:
        response = await http.request(method, url, content=b"x",
                                      headers={"Content-Type": "image/jpeg"})
    assert in_message in error_message(response, status, code)
    assert "Retry-After" not in response.headers
    assert state_of(app).stats.snapshot() == {code: 1}


async def test_405_names_the_allowed_methods(app: FastAPI) -> None:
    async with client(app) as http:
        response = await http.get("/v1/classify")
    error_message(response, 405, "method_not_allowed")
    assert response.headers["Allow"] == "POST"


@pytest.mark.parametrize(("method", "url"), [
    ("POST", "/v1/classify"), ("GET", "/v1/memory"), ("GET", "/readyz"),
])
async def test_before_warmup_503_not_ready_with_retry_after(app: FastAPI, method: str,
                                                            url: str) -> None:
    async with client(app) as http:
        response = await http.request(method, url, content=b"not even an image",
                                      headers={"Content-Type": "text/plain"})
    assert "starting" in error_message(response, 503, "not_ready")
    assert int(response.headers["Retry-After"]) >= 1


async def test_readiness_polling_is_not_counted_but_refused_work_is(app: FastAPI) -> None:
    async with client(app) as http:
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        for _ in range(3):
            assert (await http.get("/readyz")).status_code == 503
        assert (await http.post("/v1/classify", content=png())).status_code == 503
    assert state_of(app).stats.snapshot() == {"not_ready": 1}


async def test_an_unexpected_exception_is_500_without_details(app: FastAPI) -> None:
    async def explode() -> None:
        raise RuntimeError("secret detail: /home/someone/.config/vramguard/admin-token")

    app.add_api_route("/v1/explode", explode, methods=["GET"])
    # Starlette re-raises after answering (so servers log it): take the answer it sent.
    async with client(app, raise_app_exceptions=False) as http:
        response = await http.get("/v1/explode")
        series = parse((await http.get("/metrics")).text)
    message = error_message(response, 500, "internal_error")
    assert "log" in message
    assert "secret" not in response.text and "Traceback" not in response.text
    assert "RuntimeError" not in response.text
    assert state_of(app).stats.snapshot() == {"internal_error": 1}
    assert value(series, "vramguard_requests_total", route="read", status="500") == 1


async def test_an_upload_over_the_limit_is_413_even_before_warmup(tmp_path: Path) -> None:
    with built_app(tmp_path, max_body_bytes="1KiB") as app:
        async with client(app) as http:
            response = await http.post("/v1/classify", content=b"x" * 2048,
                                       headers={"Content-Type": "image/jpeg"})
    assert "larger than" in error_message(response, 413, "payload_too_large")
    assert state_of(app).stats.snapshot() == {"payload_too_large": 1}  # by the gate


async def test_the_413_message_states_a_small_limit_truthfully(tmp_path: Path) -> None:
    with built_app(tmp_path, max_body_bytes="512KiB") as app:
        async with client(app) as http:
            response = await http.post("/v1/classify", content=b"x" * 600_000,
                                       headers={"Content-Type": "image/jpeg"})
    assert "the 0 MiB limit" not in error_message(response, 413, "payload_too_large")


# --- with an engine that is ready: what the route itself refuses ------------------------


@pytest.mark.parametrize(("ctype", "body"), [
    ("text/plain", b"hello"),
    ("application/json", b"{}"),
    ("image/svg+xml", b"<svg xmlns='http://www.w3.org/2000/svg'/>"),
])
async def test_a_body_that_is_not_an_image_is_415(ready_app: FastAPI, ctype: str,
                                                  body: bytes) -> None:
    async with client(ready_app) as http:
        response = await http.post("/v1/classify", content=body,
                                   headers={"Content-Type": ctype})
    assert "image" in error_message(response, 415, "unsupported_media_type").lower()
    assert state_of(ready_app).stats.snapshot() == {"unsupported_media_type": 1}


async def test_multipart_without_a_file_field_is_400(ready_app: FastAPI) -> None:
    async with client(ready_app) as http:
        response = await http.post("/v1/classify", files={"image": ("a.png", png())})
    assert "'file'" in error_message(response, 400, "bad_request")


@pytest.mark.parametrize("body", [b"", b"\xff\xd8\xff not really a jpeg", png()[:40]])
async def test_bytes_that_do_not_decode_are_400_bad_image(ready_app: FastAPI,
                                                          body: bytes) -> None:
    async with client(ready_app) as http:
        response = await http.post("/v1/classify", content=body,
                                   headers={"Content-Type": "image/jpeg"})
    error_message(response, 400, "bad_image")
    engine = state_of(ready_app).engine
    assert isinstance(engine, ReadyEngine) and engine.samples == []


async def test_a_chunked_upload_over_the_limit_is_413_through_the_route(
        ready_app: FastAPI) -> None:
    """The body gate cuts an undeclared body off inside the route; the route's error
    mapping answers it."""

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b"x" * 1024

    async with client(ready_app) as http:
        response = await http.post("/v1/classify", content=chunks(),
                                   headers={"Content-Type": "image/png"})
    error_message(response, 413, "payload_too_large")
    assert state_of(ready_app).stats.snapshot() == {"payload_too_large": 1}


async def test_an_image_reaches_the_engine_and_the_answer_is_json(ready_app: FastAPI) -> None:
    """The contrast to the errors: decoded and preprocessed on the CPU pool, then ranked."""
    async with client(ready_app) as http:
        multipart = await http.post("/v1/classify?top_k=3", files={"file": ("a.png", png())})
        raw = await http.post("/v1/classify", content=png(64),
                              headers={"Content-Type": "image/png"})
    assert multipart.status_code == 200, multipart.text
    body = multipart.json()
    assert body["model"] == "efficientnet_lite0" and body["cached"] is False
    assert [p["label"] for p in body["predictions"]] == [LABELS[9], LABELS[8], LABELS[7]]
    assert body["batch_size"] == 1 and body["timing_ms"]["total"] >= 0
    assert raw.status_code == 200 and len(raw.json()["predictions"]) == 5
    engine = state_of(ready_app).engine
    assert isinstance(engine, ReadyEngine)
    assert [tuple(s.pixels.shape) for s in engine.samples] == [(3, 32, 32), (3, 32, 32)]
    assert [s.top_k for s in engine.samples] == [3, 5]
    assert state_of(ready_app).stats.snapshot() == {"ok": 2}


async def test_pause_refuses_cached_images_too(tmp_path: Path) -> None:
    """Paused means no answers at all, not only no model work."""
    with built_app(tmp_path, ready=True, cache=True) as app:
        async with client(app) as http:
            computed = await http.post("/v1/classify", content=png(), headers=PNG)
            cached = await http.post("/v1/classify", content=png(), headers=PNG)
            state_of(app).engine.paused = True
            paused = await http.post("/v1/classify", content=png(), headers=PNG)
    assert computed.json()["cached"] is False and cached.json()["cached"] is True
    assert "paused" in error_message(paused, 503, "paused")
    assert paused.headers["Retry-After"] == "30"
    assert state_of(app).stats.snapshot() == {"ok": 1, "cached": 1, "paused": 1}


async def hang_up_mid_upload(app: FastAPI, path: str, content_type: str) -> list[Message]:
    """Call ``app`` as a server does for a client that sends 100 of its 1000 bytes, then
    hangs up; return what the app sent (a server drops it: nobody is listening)."""
    incoming = [{"type": "http.request", "body": b"x" * 100, "more_body": True}]

    async def receive() -> Message:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": b"", "client": PEER,
             "server": ("127.0.0.1", PORT),
             "headers": [(b"host", f"127.0.0.1:{PORT}".encode()),
                         (b"content-type", content_type.encode()),
                         (b"content-length", b"1000")]}
    await app(scope, receive, send)
    return sent


@pytest.mark.parametrize(("path", "content_type"), [
    ("/v1/classify", "image/png"),  # the route reads the body itself
    ("/v1/ui/session", "application/json"),  # FastAPI reads it for the route
])
async def test_a_client_that_hangs_up_mid_upload_is_499_without_a_traceback(
        ready_app: FastAPI, caplog: pytest.LogCaptureFixture, path: str,
        content_type: str) -> None:
    with caplog.at_level(logging.INFO):
        sent = await hang_up_mid_upload(ready_app, path, content_type)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert state_of(ready_app).stats.snapshot() == {"client_closed": 1}
    assert [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info] == []
