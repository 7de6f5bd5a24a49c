"""Several real models in one process on the CPU: loaded on request, evicted by measured
memory (a model of the user's own among them), kept alive and unloaded, profiles reused,
embeddings.

In-process: the real app and the real engine (models loaded and warmed up on its device
thread), requests through httpx's ASGI transport. The profiles are measured once for the
module (the first load of each model) and reused by every later engine, as a second start
of the appliance would.
"""

from __future__ import annotations

import asyncio
import io
import logging
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from images import photo
from live_server import ROOT
from PIL import Image

from app.config import load_settings
from app.engine.engine import InferenceEngine
from app.engine.residency import Footprint, needed
from app.http.server import create_app
from app.http.state import AppState

LITE = ("efficientnet_lite0", "efficientnet_lite1", "efficientnet_lite2")
OWN = "mine"  # a model of the user's own, from the models folder
JPEG = {"Content-Type": "image/jpeg"}
BACKGROUND_WAIT_S = 120.0  # bounds the wait for the batch sizes measured between batches


@pytest.fixture(scope="module")
def profiles(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profiles")


@asynccontextmanager
async def appliance(tmp_path: Path, profiles: Path, **overrides: Any
                    ) -> AsyncIterator[tuple[httpx.AsyncClient, InferenceEngine]]:
    """The app with a started engine on the CPU, and a client for it."""
    values: dict[str, Any] = {
        "cache": False, "cache_dir": tmp_path / "cache", "token_file": tmp_path / "token",
        "device": "cpu", "max_batch_size": 2, "rate_limit": False, "profile_dir": profiles,
        "min_residency_s": 0, "request_timeout_s": 60, **overrides}
    settings = load_settings(**values)
    app = create_app(settings)
    state: AppState = app.state.vg
    engine = state.engine
    await engine.start()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, timeout=120,
                                     base_url=f"http://127.0.0.1:{settings.port}") as client:
            yield client, engine
    finally:
        await asyncio.to_thread(engine.stop)
        state.pool.shutdown()
        state.decoder.close()


async def top1(client: httpx.AsyncClient, model: str, body: bytes,
               headers: dict[str, str] | None = None, **params: Any) -> str:
    response = await client.post("/v1/classify", params={"model": model, **params},
                                 content=body, headers={**JPEG, **(headers or {})})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    label: str = response.json()["predictions"][0]["label"]
    return label


async def listing(client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    response = await client.get("/v1/models")
    assert response.status_code == 200, response.text
    return {m["name"]: m for m in response.json()["models"]}


def footprint(model: dict[str, Any]) -> Footprint:
    return Footprint(model["weights_bytes"],
                     model["fixed_bytes"] + model["bytes_per_sample"] * model["batch_size"])


@pytest.fixture(scope="module")
def measured(profiles: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, dict[str, Any]]:
    """Every Lite model loaded once in one process, each classifying the espresso photo;
    what /v1/models said about them once the two loaded on demand had measured their other
    batch sizes in the background. Their profiles are now stored."""

    async def scenario() -> tuple[dict[str, dict[str, Any]], list[str]]:
        async with appliance(tmp_path_factory.mktemp("three"), profiles) as (client, engine):
            labels = [await top1(client, name, photo()) for name in LITE]
            assert sorted(engine.batcher.lane(n).name for n in LITE) == list(LITE)
            assert (await listing(client))[LITE[0]]["profile_complete"]  # measured at start
            give_up = time.monotonic() + BACKGROUND_WAIT_S
            models = await listing(client)
            while not all(models[n]["profile_complete"] for n in LITE):
                assert time.monotonic() < give_up, models
                await asyncio.sleep(0.2)
                models = await listing(client)
            return models, labels

    models, labels = asyncio.run(scenario())
    models["labels"] = {"top1": labels}
    return models


def test_three_catalogue_models_serve_in_one_process(measured: dict[str, Any]) -> None:
    assert measured["labels"]["top1"] == ["espresso"] * 3
    for name in LITE:
        model = measured[name]
        assert model["state"] == "loaded" and model["weights_bytes"] > 10_000_000
        assert model["bytes_per_sample"] > 0 and model["batch_size"] >= 1
        assert model["profile_reused"] is False  # first load: measured
    assert measured[LITE[0]]["pinned"] is True
    assert measured[LITE[1]]["pinned"] is False and measured[LITE[1]]["keep_alive_s"] == 300
    assert [measured[n]["input_size"] for n in LITE] == [224, 240, 260]


def test_a_budget_for_two_evicts_the_least_recently_used_idle_model_never_the_pinned(
        measured: dict[str, Any], profiles: Path, tmp_path: Path) -> None:
    """Loads go through the admin route, which takes the same path as a request naming a
    model: the budget for images in flight here is a few MB over one batch, and on this
    shared CPU other processes' memory (the stand-in for other programs on a GPU) moves
    by more than that, so classifying under it would test the machine, not the choice."""
    prints = {name: footprint(measured[name]) for name in LITE}
    pairs = [needed([prints[a], prints[b]]) for a, b in
             [(LITE[0], LITE[1]), (LITE[0], LITE[2])]]
    budget = max(pairs) + 1_000_000
    assert needed(prints.values()) > budget, "the three must not fit together"

    async def scenario() -> None:
        async with appliance(tmp_path, profiles, memory_budget=budget) as (client, engine):
            admin = {"Authorization": f"Bearer {(tmp_path / 'token').read_text().strip()}"}

            async def load(name: str) -> list[str]:
                response = await client.post(f"/v1/models/{name}/load", headers=admin)
                assert response.status_code == 200, response.text
                states = {n: m["state"] for n, m in (await listing(client)).items()}
                return [states[n] for n in LITE]

            assert await load(LITE[1]) == ["loaded", "loaded", "available"]
            assert await load(LITE[2]) == ["loaded", "available", "loaded"]  # lite1 evicted
            memory = (await client.get("/v1/memory")).json()
            assert [m["name"] for m in memory["models"]] == [LITE[0], LITE[2]]
            weights = sum(m["weights_bytes"] for m in memory["models"])
            assert memory["weights_bytes"] == weights
            # One budget for images in flight: the room less both models' weights.
            assert memory["configured_budget_bytes"] == budget - weights
            # lite0 is now the least recently used, but pinned: lite2 goes instead.
            assert await load(LITE[1]) == ["loaded", "loaded", "available"]
            assert engine.outcomes[LITE[1]].unloads == {"evicted": 1}
            assert engine.outcomes[LITE[2]].unloads == {"evicted": 1}
            assert LITE[0] not in engine.outcomes or not engine.outcomes[LITE[0]].unloads
            metrics = (await client.get("/metrics")).text
            assert f'vramguard_model_unloads_total{{model="{LITE[1]}",reason="evicted"}} 1.0' \
                in metrics

    asyncio.run(scenario())


def test_a_budget_below_one_model_answers_insufficient_memory_and_stays_healthy(
        measured: dict[str, Any], profiles: Path, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with appliance(tmp_path, profiles, memory_budget=1_000_000) as (client, engine):
            assert engine.ready and not engine.runtimes
            response = await client.post("/v1/classify", content=photo(), headers=JPEG)
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["code"] == "insufficient_memory"
            assert LITE[0] in error["message"] and "memory_budget" in error["message"]
            assert (await client.get("/healthz")).status_code == 200

    asyncio.run(scenario())


def test_keep_alive_zero_and_expiry_unload_and_loads_are_rate_limited(
        measured: dict[str, Any], profiles: Path, tmp_path: Path) -> None:
    async def state_of(client: httpx.AsyncClient, name: str) -> str:
        return str((await listing(client))[name]["state"])

    async def scenario() -> None:
        async with appliance(tmp_path, profiles, max_loads_per_minute=2) as (client, engine):
            # A shorter stay than keep_alive_s needs the admin token (tests/inprocess/
            # test_model_churn.py: without it, it is ignored).
            admin = {"Authorization": f"Bearer {(tmp_path / 'token').read_text().strip()}"}
            assert await top1(client, LITE[1], photo(), admin, keep_alive=0) == "espresso"
            for _ in range(50):  # the unload is queued on the device thread after the answer
                if await state_of(client, LITE[1]) == "available":
                    break
                await asyncio.sleep(0.05)
            assert await state_of(client, LITE[1]) == "available"
            assert await top1(client, LITE[2], photo(), admin, keep_alive=3) == "espresso"
            await engine.on_device(engine.tick)
            assert await state_of(client, LITE[2]) == "loaded"  # not expired yet
            await asyncio.sleep(3.1)
            await engine.on_device(engine.tick)
            assert await state_of(client, LITE[2]) == "available"
            assert engine.outcomes[LITE[2]].unloads == {"expired": 1}
            # Two loads in this minute already: a third is refused, with when to retry.
            response = await client.post("/v1/classify", params={"model": LITE[1]},
                                         content=photo(), headers=JPEG)
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "overloaded"
            assert 1 <= int(response.headers["Retry-After"]) <= 60
            assert (await listing(client))[LITE[0]]["state"] == "loaded"  # pinned stays

    asyncio.run(scenario())


def test_a_second_start_reuses_the_stored_profiles(
        measured: dict[str, Any], profiles: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> dict[str, dict[str, Any]]:
        async with appliance(tmp_path, profiles, models=[LITE[1]]) as (client, _engine):
            return await listing(client)

    with caplog.at_level(logging.INFO, logger="vramguard.engine"):
        models = asyncio.run(scenario())
    for name in LITE[:2]:
        assert models[name]["profile_reused"] is True and models[name]["pinned"] is True
        # The stored timings and memory figures are the first measurement's.
        assert models[name]["warmup"] == measured[name]["warmup"]
        assert models[name]["bytes_per_sample"] == measured[name]["bytes_per_sample"]
    assert f"{LITE[0]}: reused the profile measured on" in caplog.text


def test_admin_loads_and_unloads_by_catalogue_name_only(
        measured: dict[str, Any], profiles: Path, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with appliance(tmp_path, profiles) as (client, engine):
            token = (tmp_path / "token").read_text().strip()
            admin = {"Authorization": f"Bearer {token}"}
            url = f"/v1/models/{LITE[2]}/load"
            assert (await client.post(url)).status_code == 401
            loaded = await client.post(url, headers=admin)
            assert loaded.status_code == 200, loaded.text
            assert loaded.json()["state"] == "loaded" and loaded.json()["keep_alive_s"] == -1
            for name in ("..%2F..%2Fetc%2Fpasswd", "resnet50", "x" * 65):
                response = await client.post(f"/v1/models/{name}/load", headers=admin)
                assert response.status_code in (400, 404), (name, response.text)
            gone = await client.post(f"/v1/models/{LITE[2]}/unload", headers=admin)
            assert gone.status_code == 200, gone.text
            assert (await listing(client))[LITE[2]]["state"] == "available"
            again = await client.post(f"/v1/models/{LITE[2]}/unload", headers=admin)
            assert again.status_code == 404
            assert engine.outcomes[LITE[2]].unloads == {"admin": 1}

    asyncio.run(scenario())


def _recompressed(body: bytes) -> bytes:
    """The same photo at 60 % of its size, saved again as a lower-quality JPEG."""
    image = Image.open(io.BytesIO(body)).convert("RGB")
    image = image.resize((image.width * 3 // 5, image.height * 3 // 5), Image.LANCZOS)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=70)
    return out.getvalue()


def test_embeddings_find_the_same_photo_resized_and_are_cached_apart(
        measured: dict[str, Any], profiles: Path, tmp_path: Path) -> None:
    async def embed(client: httpx.AsyncClient, body: bytes) -> dict[str, Any]:
        response = await client.post("/v1/embed", content=body, headers=JPEG)
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    async def scenario() -> None:
        async with appliance(tmp_path, profiles, cache=True) as (client, _engine):
            espresso = await embed(client, photo())
            copy = await embed(client, _recompressed(photo()))
            cat = await embed(client, photo("chelsea.jpg"))
            vectors = [np.array(a["embedding"]) for a in (espresso, copy, cat)]
            assert [len(v) for v in vectors] == [1280] * 3 and espresso["dimensions"] == 1280
            for vector in vectors:
                assert abs(np.linalg.norm(vector) - 1) < 1e-4
            same, to_cat, copy_to_cat = (vectors[0] @ vectors[1], vectors[0] @ vectors[2],
                                         vectors[1] @ vectors[2])
            assert same > max(to_cat, copy_to_cat) + 0.2, (same, to_cat, copy_to_cat)
            again = await embed(client, photo())
            assert again["cached"] is True and espresso["cached"] is False
            assert np.allclose(again["embedding"], espresso["embedding"], atol=1e-6)
            # The embedding's cache entry is not a classification's.
            classified = await client.post("/v1/classify", content=photo(), headers=JPEG)
            assert classified.json()["cached"] is False
            assert classified.json()["predictions"][0]["label"] == "espresso"

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def own_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models folder holding one model of the user's own: torchvision's MobileNetV3-Small
    for three labels (untrained: this is about memory), added as `vramguard models add`
    adds it, its trial load included."""
    import torchvision
    from safetensors.torch import save_file

    from app.models.own.store import OwnModels

    sys.path.insert(0, str(ROOT / "docs" / "own_models"))
    from saving import write_manifest

    source = tmp_path_factory.mktemp("own-source") / "mine"
    source.mkdir()
    torch.manual_seed(0)
    save_file(torchvision.models.mobilenet_v3_small(num_classes=3).state_dict(),
              str(source / "weights.safetensors"))
    write_manifest(source, format="torchvision", file="weights.safetensors",
                   architecture="mobilenet_v3_small")
    root = tmp_path_factory.mktemp("own-models")
    OwnModels(root).add(source, OWN)
    return root


@pytest.fixture(scope="module")
def own_measured(measured: dict[str, Any], profiles: Path, own_models: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """/v1/models once the own model has been loaded (and so measured) beside Lite0."""
    async def scenario() -> dict[str, dict[str, Any]]:
        async with appliance(tmp_path_factory.mktemp("own"), profiles,
                             models_dir=own_models) as (client, _engine):
            response = await client.post("/v1/classify", params={"model": OWN},
                                         content=photo(), headers=JPEG)
            assert response.status_code == 200, response.text
            give_up = time.monotonic() + BACKGROUND_WAIT_S
            models = await listing(client)
            while not models[OWN]["profile_complete"]:  # then its profile is stored
                assert time.monotonic() < give_up, models[OWN]
                await asyncio.sleep(0.2)
                models = await listing(client)
            return models

    return asyncio.run(scenario())


def test_an_own_model_and_a_built_in_one_share_the_budget_and_are_evicted_alike(
        measured: dict[str, Any], own_measured: dict[str, Any], own_models: Path,
        profiles: Path, tmp_path: Path) -> None:
    """Lite0 pinned, then the own model and Lite1 by turns under a budget for Lite0 and
    either one: each load evicts the other, as between built-in models."""
    prints = {name: footprint(measured[name]) for name in LITE}
    prints[OWN] = footprint(own_measured[OWN])
    assert own_measured[OWN]["weights_bytes"] > 5_000_000
    budget = max(needed([prints[LITE[0]], prints[other]]) for other in (OWN, LITE[1])) \
        + 1_000_000
    assert needed([prints[LITE[0]], prints[OWN], prints[LITE[1]]]) > budget

    async def scenario() -> None:
        async with appliance(tmp_path, profiles, memory_budget=budget,
                             models_dir=own_models) as (client, engine):
            admin = {"Authorization": f"Bearer {(tmp_path / 'token').read_text().strip()}"}

            async def load(name: str) -> list[str]:
                response = await client.post(f"/v1/models/{name}/load", headers=admin)
                assert response.status_code == 200, response.text
                states = {n: m["state"] for n, m in (await listing(client)).items()}
                return [states[n] for n in (LITE[0], OWN, LITE[1])]

            assert await load(OWN) == ["loaded", "loaded", "available"]
            assert (await listing(client))[OWN]["profile_reused"] is True
            assert await load(LITE[1]) == ["loaded", "available", "loaded"]  # own evicted
            assert await load(OWN) == ["loaded", "loaded", "available"]  # and back
            assert engine.outcomes[OWN].unloads == {"evicted": 1}
            assert engine.outcomes[LITE[1]].unloads == {"evicted": 1}

    asyncio.run(scenario())


def test_an_own_model_too_big_for_the_budget_gets_insufficient_memory_naming_it(
        measured: dict[str, Any], own_measured: dict[str, Any], own_models: Path,
        profiles: Path, tmp_path: Path) -> None:
    lite0 = footprint(measured[LITE[0]])
    budget = needed([lite0]) + 1_000_000
    assert needed([lite0, footprint(own_measured[OWN])]) > budget

    async def scenario() -> None:
        async with appliance(tmp_path, profiles, memory_budget=budget,
                             models_dir=own_models) as (client, engine):
            response = await client.post("/v1/classify", params={"model": OWN},
                                         content=photo(), headers=JPEG)
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["code"] == "insufficient_memory" and OWN in error["message"]
            assert (await client.get("/healthz")).status_code == 200
            # Lite0 stays (not classified here: see the eviction test above for why).
            assert sorted(engine.runtimes) == [LITE[0]]
            assert (await listing(client))[OWN]["state"] == "available"

    asyncio.run(scenario())
