"""Model churn, as the attack: a program looping ``?model=…&keep_alive=0`` cannot unload
another app's model nor use up the loads of the others; a bodiless or malformed ``/v2``
request loads nothing. A real engine (its device thread, loads, keep-alive and expiry)
with a small real model standing in for the catalogue's, the real app over ASGI."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from asgi import built_app, state_of
from images import photo
from tiny_model import tiny_model

from app.api.keep_alive import HEADER
from app.engine.engine import InferenceEngine
from app.models import LoadedModel

LITE1, LITE2 = "efficientnet_lite1", "efficientnet_lite2"
IGNORED = "ignored; shorter stays and -1 need the admin token"
POLL_S, POLLS = 0.02, 250  # an unload queued on the device thread: at most 5 s


def stand_in(name: str, device: Any, weights: Path | None) -> LoadedModel:
    return dataclasses.replace(tiny_model(), name=name)


@asynccontextmanager
async def appliance(tmp_path: Path, **settings: Any
                    ) -> AsyncIterator[tuple[httpx.AsyncClient, InferenceEngine, str]]:
    """The app with a started engine; a client, the engine and the admin token."""
    with built_app(tmp_path, request_timeout_s=10.0, profile_dir=tmp_path / "profiles",
                   max_batch_size=1, min_residency_s=0, **settings) as app:
        state = state_of(app)
        engine = state.engine = InferenceEngine(state.settings, model_loader=stand_in)
        await engine.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://127.0.0.1:8765") as client:
                yield client, engine, state.admin_token.current()
        finally:
            await asyncio.to_thread(engine.stop)


def classify(client: httpx.AsyncClient, app: str, model: str, token: str | None = None,
             **params: Any) -> Any:
    headers = {"Content-Type": "image/jpeg", "X-Client-Id": app}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return client.post("/v1/classify", params={"model": model, **params}, content=photo(),
                       headers=headers)


async def listed(client: httpx.AsyncClient, name: str) -> dict[str, Any]:
    models = (await client.get("/v1/models")).json()["models"]
    return next(m for m in models if m["name"] == name)


async def until_unloaded(client: httpx.AsyncClient, name: str) -> None:
    for _ in range(POLLS):
        if (await listed(client, name))["state"] == "available":
            return
        await asyncio.sleep(POLL_S)
    raise AssertionError(f"{name} was not unloaded")


def test_keep_alive_zero_from_another_app_leaves_the_stay_as_it_was(tmp_path: Path) -> None:
    async def run() -> None:
        async with appliance(tmp_path) as (client, engine, token):
            kept = await classify(client, "photos-app", LITE1, keep_alive=3600)
            assert kept.status_code == 200 and HEADER not in kept.headers
            for _ in range(8):  # the churn: every answer served, nothing unloaded
                churn = await classify(client, "churner", LITE1, keep_alive=0)
                assert churn.status_code == 200, churn.text
                assert churn.headers[HEADER] == IGNORED
            forever = await classify(client, "churner", LITE1, keep_alive=-1)
            assert forever.status_code == 200 and forever.headers[HEADER] == IGNORED
            capped = await classify(client, "churner", LITE1, keep_alive=86400)
            assert capped.headers[HEADER] == (
                "capped; the longest stay a request may ask for is 3600 s")
            await asyncio.sleep(0.2)  # an unload would have been queued by now
            await engine.on_device(engine.tick)
            model = await listed(client, LITE1)
            assert model["state"] == "loaded" and model["keep_alive_s"] == 3600
            assert engine.outcomes[LITE1].loads == 1 and not engine.outcomes[LITE1].unloads

            # With the admin token a request sets any stay, as before: 0 unloads it.
            admin = await classify(client, "photos-app", LITE1, token, keep_alive=0)
            assert admin.status_code == 200 and HEADER not in admin.headers
            await until_unloaded(client, LITE1)

    asyncio.run(run())


def test_one_app_churning_loads_gets_its_share_and_another_app_still_loads(
        tmp_path: Path) -> None:
    async def run() -> None:
        async with appliance(tmp_path, max_loads_per_minute=6,
                             max_loads_per_client_per_minute=3) as (client, engine, token):
            # The churner holds the token (it may unload), so each request is a load.
            for _ in range(3):
                churn = await classify(client, "churner", LITE1, token, keep_alive=0)
                assert churn.status_code == 200, churn.text
                await until_unloaded(client, LITE1)
            refused = await classify(client, "churner", LITE1, token, keep_alive=0)
            assert refused.status_code == 503, refused.text
            error = refused.json()["error"]
            assert error["code"] == "overloaded"
            assert "Requests from this app (127.0.0.1/churner#admin)" in error["message"]
            assert "3 models in the last minute, the most one app may" in error["message"]
            assert 1 <= int(refused.headers["Retry-After"]) <= 60
            assert f"Try again in {refused.headers['Retry-After']} s" in error["message"]
            other = await classify(client, "photos-app", LITE2, keep_alive=600)
            assert other.status_code == 200, other.text
            assert (await listed(client, LITE2))["state"] == "loaded"
            assert engine.outcomes[LITE1].loads == 3

    asyncio.run(run())


def image_body() -> dict[str, Any]:
    return {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1],
                        "data": [base64.b64encode(photo()).decode()]}]}


def test_a_bodiless_or_malformed_v2_request_loads_nothing(tmp_path: Path) -> None:
    json = {"Content-Type": "application/json"}
    bodies = {"no body": b"", "empty object": b"{}", "not JSON": b"{not json",
              "unknown input": b'{"inputs": [{"name": "X", "datatype": "BYTES", '
                               b'"shape": [1], "data": ["aGk="]}]}',
              "pixels of the wrong shape": b'{"inputs": [{"name": "PIXELS", "datatype": '
                                           b'"FP32", "shape": [1, 3, 2, 2], "data": []}]}'}

    async def run() -> None:
        async with appliance(tmp_path) as (client, engine, _token):
            for what, body in bodies.items():
                answer = await client.post(f"/v2/models/{LITE1}/infer", content=body,
                                           headers=json)
                assert answer.status_code == 400, (what, answer.text)
                assert LITE1 not in engine.runtimes and LITE1 not in engine.outcomes, what
            assert (await listed(client, LITE1))["state"] == "available"
            good = await client.post(f"/v2/models/{LITE1}/infer", json=image_body())
            assert good.status_code == 200, good.text
            assert engine.outcomes[LITE1].loads == 1

    asyncio.run(run())


def test_the_stream_charges_its_caller_and_says_a_keep_alive_was_ignored(
        tmp_path: Path) -> None:
    """The stream is a way in too: its keep_alive=0 leaves the stay, its answer says so,
    and its loads count against its own app's share."""
    files = [("file", (f"{i}.jpg", photo(), "image/jpeg")) for i in range(2)]

    async def stream(client: httpx.AsyncClient, app: str, model: str) -> httpx.Response:
        return await client.post("/v1/classify/stream",
                                 params={"model": model, "keep_alive": 0}, files=files,
                                 headers={"X-Client-Id": app})

    async def run() -> None:
        async with appliance(tmp_path, max_loads_per_client_per_minute=1) as (
                client, _engine, _token):
            first = await stream(client, "churner", LITE1)
            assert first.status_code == 200, first.text
            assert first.headers[HEADER] == IGNORED
            assert (await listed(client, LITE1))["state"] == "loaded"
            refused = await stream(client, "churner", LITE2)  # its one load is spent
            assert refused.status_code == 503, refused.text
            other = await stream(client, "photos-app", LITE2)
            assert other.status_code == 200, other.text

    asyncio.run(run())
