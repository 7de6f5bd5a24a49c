"""The Python client (clients/python) against real servers: discovery of the running one,
the real model, broken images in a batch, errors and admin calls, the async client, and a
429's Retry-After by the server's own clock (on mock transports:
unit/clients/test_client_python.py)."""

from __future__ import annotations

import asyncio
import io
import math
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import vramguard_client as vg
from images import DATA, encode, photo
from live_server import USER_DIRS, live_server
from PIL import Image

ACCESS_LINE = re.compile(r"^(\S+ \S+) \w+ uvicorn\.access: .*\"POST /v1/classify\?top_k=(\d+) "
                         r"HTTP/1\.1\" (\d{3})", re.MULTILINE)


def broken_jpeg() -> bytes:
    return photo()[:2000]


def batch(tmp_path: Path) -> list[vg.ImageInput]:
    """Twelve inputs: paths, bytes and PIL images of two photos, and two broken files."""
    coffee, cat = Image.open(DATA / "coffee.jpg"), Image.open(DATA / "chelsea.jpg")
    items: list[vg.ImageInput] = [DATA / "coffee.jpg", str(DATA / "chelsea.jpg"), photo(),
                                  photo("chelsea.jpg"), coffee, cat]
    for size in (200, 300, 400, 500):
        items.append(encode(coffee.convert("RGB").resize((size, size)), "JPEG"))
    (tmp_path / "text.jpg").write_text("not an image")
    items[4:4] = [tmp_path / "text.jpg"]
    items.append(broken_jpeg())
    return items


@pytest.fixture
def home_of(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any], None]:
    """Give this test process the user folders a live server was started with."""

    def use(server: Any) -> None:
        for var in USER_DIRS:
            monkeypatch.setenv(var, str(server.home / var.lower()))
        monkeypatch.setenv("VRAMGUARD_TOKEN_FILE", str(server.token_file))

    return use


def test_client_finds_the_running_server_by_itself(server, home_of):
    home_of(server)
    with vg.Client() as client:
        assert (client.url, client.location.source) == (server.url, "instance")
        result = client.classify(DATA / "coffee.jpg")
    assert result.top.label == "espresso" and result.top.index == 967
    assert result.model == "efficientnet_lite0" and result.batch_size >= 1
    assert len(result.predictions) == 5 and "total" in result.timing_ms


def test_classify_and_embed_on_the_real_model(server):
    with vg.Client(server.url) as client:
        from_bytes = client.classify(photo(), top_k=2)
        from_pil = client.classify(Image.open(io.BytesIO(photo())))
        coffee, again = client.embed(DATA / "coffee.jpg"), client.embed(photo())
        cat = client.embed(DATA / "chelsea.jpg")
    assert from_bytes.top.label == from_pil.top.label == "espresso"
    assert len(from_bytes.predictions) == 2
    assert coffee.dimensions == len(coffee.vector) == 1280
    assert math.isclose(math.fsum(v * v for v in coffee.vector), 1.0, abs_tol=1e-4)
    assert coffee.similarity(again) > 0.999 and cat.similarity(coffee) < 0.9


def test_classify_many_with_two_broken_images(server, tmp_path):
    images = batch(tmp_path)
    progress: list[tuple[int, int | None]] = []
    with vg.Client(server.url) as client:
        outcomes = list(client.classify_many(images, concurrency=4,
                                             on_progress=lambda *p: progress.append(p)))
    assert sorted(o.index for o in outcomes) == list(range(12))
    assert progress == [(done, 12) for done in range(1, 13)]
    failed = {o.index: o.error for o in outcomes if not o.ok}
    assert sorted(failed) == [4, 11]
    assert all(isinstance(e, vg.BadImage) and e.message for e in failed.values())
    for outcome in outcomes:
        assert outcome.image is images[outcome.index]
        if outcome.ok:
            assert outcome.result.top.label in {"espresso", "tabby", "tiger cat", "Egyptian cat"}


def test_real_errors_and_admin_calls(server, tmp_path):
    with vg.Client(server.url) as client:
        with pytest.raises(vg.BadImage):
            client.classify(b"definitely not an image")
        with pytest.raises(vg.NotFound, match="no_such_model"):
            client.classify(photo(), model="no_such_model")
        with pytest.raises(vg.BadRequest, match="top_k"):
            client.classify(photo(), top_k=0)
        models = {m.name: m for m in client.models()}
        assert models["efficientnet_lite0"].loaded and models["efficientnet_lite0"].pinned
        memory = client.memory()
        assert memory.state in {"ok", "high", "shedding"} and memory.total_bytes > 0
    with vg.Client(server.url, token_file=tmp_path / "none") as client, \
            pytest.raises(vg.Unauthorized, match="admin token file"):
        client.empty_cache()
    with vg.Client(server.url, token_file=server.token_file) as admin:
        assert admin.empty_cache().freed_bytes >= 0
        assert admin.load_model("efficientnet_lite0").loaded
        with pytest.raises(vg.NotFound, match="not loaded"):
            admin.unload_model("no_such_model")
        admin.pause()
        try:
            with pytest.raises(vg.Paused) as paused:
                admin.classify(photo())
            assert paused.value.status == 503 and paused.value.retry_after
        finally:
            admin.resume()
        assert admin.classify(photo()).top.label == "espresso"


def test_async_client(server, tmp_path, home_of):
    home_of(server)
    images = batch(tmp_path)
    progress: list[int] = []

    async def run() -> tuple[vg.Classification, vg.Embedding, list[vg.Outcome[vg.Classification]],
                             float]:
        async with vg.AsyncClient() as client:
            assert client.url == server.url
            single = await client.classify(DATA / "coffee.jpg")
            features = await client.embed(photo())
            outcomes = [o async for o in client.classify_many(
                images, concurrency=3, on_progress=lambda done, _: progress.append(done))]
            freed = (await client.empty_cache()).freed_bytes
        return single, features, outcomes, freed

    single, features, outcomes, freed = asyncio.run(run())
    assert single.top.label == "espresso" and features.dimensions == 1280 and freed >= 0
    assert sorted(o.index for o in outcomes) == list(range(12)) and progress == list(range(1, 13))
    assert sorted(o.index for o in outcomes if not o.ok) == [4, 11]


def access_log(text: str) -> list[tuple[float, int, int]]:
    """(time, top_k, status) of each classify request in the server's access log."""
    return [(datetime.strptime(when, "%Y-%m-%d %H:%M:%S,%f").timestamp(), int(k), int(status))
            for when, k, status in ACCESS_LINE.findall(text)]


def test_a_429_makes_the_client_wait_the_servers_retry_after(tmp_path):
    """One classify token, refilled every 2 s, and two calls at once (told apart by their
    top_k): one is refused with Retry-After 2, and by the server's own clock (its log)
    arrives again no sooner."""
    env = {"VRAMGUARD_CLASSIFY_BURST": "1", "VRAMGUARD_CLASSIFY_PER_S": "0.5",
           "VRAMGUARD_LOG_LEVEL": "debug"}
    with live_server(tmp_path, "--no-cache", env=env) as limited, \
            vg.Client(limited.url) as client, ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda k: client.classify(photo(), top_k=k), [1, 2]))
        stats = httpx.get(f"{limited.url}/v1/stats").json()
        log = access_log(limited.log_text())
    assert [r.top.label for r in results] == ["espresso", "espresso"]
    assert stats["rate_limited"] == 1  # one refusal, not a flood of them
    [(refused_at, k, _)] = [line for line in log if line[2] == 429]
    [(answered_at, _, _)] = [line for line in log if line[1] == k and line[2] == 200]
    assert sorted(status for _, _, status in log) == [200, 200, 429]
    arrived_again = answered_at - results[k - 1].timing_ms["total"] / 1000
    assert arrived_again - refused_at >= 2.0 - 0.05
