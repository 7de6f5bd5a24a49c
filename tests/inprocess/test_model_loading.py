"""A model being loaded answers 503 ``loading`` with a Retry-After, on /v1 and /v2 alike,
and /v1/models shows it ``loading``; a torchvision model without its weights file is told
where to put it; a cached answer has no batch size. A real engine with a small real model
standing in for the catalogue's (loaded under their names), its load held by the test."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from asgi import built_app, state_of
from images import photo
from tiny_model import tiny_model

from app.engine.engine import InferenceEngine
from app.models import LoadedModel

HELD = "efficientnet_lite1"
WAIT_S = 60.0


class HeldLoader:
    """Loads tiny_model under any name; the load of ``HELD`` waits for ``release``."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __call__(self, name: str, device: torch.device, weights: Path | None) -> LoadedModel:
        if name == HELD:
            self.release.wait(WAIT_S)
        return dataclasses.replace(tiny_model(), name=name)


@asynccontextmanager
async def appliance(tmp_path: Path, **settings: Any
                    ) -> AsyncIterator[tuple[httpx.AsyncClient, HeldLoader]]:
    loader = HeldLoader()
    with built_app(tmp_path, request_timeout_s=3.0, profile_dir=tmp_path / "profiles",
                   max_batch_size=2, **settings) as app:
        state = state_of(app)
        engine = state.engine = InferenceEngine(state.settings, model_loader=loader)
        await engine.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://127.0.0.1:8765") as client:
                yield client, loader
        finally:
            loader.release.set()
            await asyncio.to_thread(engine.stop)


def one_image() -> dict[str, Any]:
    """A valid /v2 body (a request is checked before it loads its model)."""
    return {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1],
                        "data": [base64.b64encode(photo()).decode()]}]}


def classify(client: httpx.AsyncClient, model: str) -> Any:
    return client.post("/v1/classify", params={"model": model}, content=photo(),
                       headers={"Content-Type": "image/jpeg"})


async def state_of_model(client: httpx.AsyncClient, name: str) -> dict[str, Any]:
    listed = (await client.get("/v1/models")).json()["models"]
    return next(m for m in listed if m["name"] == name)


def test_a_model_being_loaded_answers_loading_with_retry_after(tmp_path: Path) -> None:
    async def run() -> None:
        async with appliance(tmp_path) as (client, loader):
            answer = await classify(client, HELD)
            assert answer.status_code == 503
            error = answer.json()["error"]
            assert error["code"] == "loading" and HELD in error["message"]
            seconds = int(answer.headers["retry-after"])
            assert seconds >= 1 and f"try again in {seconds} s" in error["message"]
            assert (await state_of_model(client, HELD))["state"] == "loading"

            infer = await client.post(f"/v2/models/{HELD}/infer", json=one_image())
            assert infer.status_code == 503 and int(infer.headers["retry-after"]) >= 1
            assert infer.json() == {"error": error["message"].replace(
                f"{seconds} s", f"{infer.headers['retry-after']} s")}
            ready = await client.get(f"/v2/models/{HELD}/ready")
            assert ready.status_code == 503 and "being loaded" in ready.json()["error"]

            loader.release.set()
            for _ in range(int(WAIT_S / 0.05)):
                if (await state_of_model(client, HELD))["state"] == "loaded":
                    break
                await asyncio.sleep(0.05)
            done = await classify(client, HELD)
            assert done.status_code == 200, done.text
            assert done.json()["model"] == HELD and done.json()["batch_size"] == 1

    asyncio.run(run())


def test_a_torchvision_model_without_weights_says_where_to_put_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # no weights downloaded here

    async def run() -> None:
        async with appliance(tmp_path) as (client, _):
            for answer in (await classify(client, "resnet50"),
                           await client.get("/v2/models/resnet50/ready")):
                assert answer.status_code == 404
                text = answer.text
                assert "No weights for 'resnet50' on this computer" in text, text
                assert "resnet50-" in text and str(tmp_path / "torch") in text
                assert "There is no model called" not in text
            unknown = await classify(client, "no-such-model")
            assert "There is no model called 'no-such-model'" in unknown.text

    asyncio.run(run())


def test_a_cached_answer_has_no_batch_size(tmp_path: Path) -> None:
    async def run() -> None:
        async with appliance(tmp_path, cache=True) as (client, _):
            first = (await classify(client, "efficientnet_lite0")).json()
            second = (await classify(client, "efficientnet_lite0")).json()
            assert first["cached"] is False and first["batch_size"] == 1
            assert second["cached"] is True and second["batch_size"] is None

    asyncio.run(run())
