"""The classify route keys the result cache by the loaded weights, not just the image.

In-process: the real app and the real engine (model loaded and warmed up on its device
thread), requests through httpx's ASGI transport; no server process, no port.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import httpx
from images import photo

from app.config import load_settings
from app.http.server import create_app
from app.http.state import AppState


async def _classify(client: httpx.AsyncClient, body: bytes) -> dict[str, Any]:
    response = await client.post("/v1/classify", content=body,
                                 headers={"Content-Type": "image/jpeg"})
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def _scenario(tmp_path: Path) -> list[bool]:
    """Classify one photo twice, change the weights fingerprint, classify it twice more;
    return the four ``cached`` flags."""
    settings = load_settings(cache=True, cache_dir=tmp_path / "cache",
                             token_file=tmp_path / "admin-token", device="cpu",
                             max_batch_size=1, rate_limit=False)  # warmup: one size
    app = create_app(settings)
    state: AppState = app.state.vg
    engine = state.engine
    await engine.start()
    try:
        assert engine.ready, engine.error
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport,
                                     base_url=f"http://127.0.0.1:{settings.port}") as client:
            body = photo()
            flags = [(await _classify(client, body))["cached"] for _ in range(2)]
            # New weights: the same model name with another fingerprint. The runtime is
            # frozen, so install a new one, as a reload would.
            runtime = engine.require_runtime()
            assert runtime.model.weights_version
            reloaded = dataclasses.replace(runtime.model,
                                           weights_version=runtime.model.weights_version + "-2")
            engine.runtimes[reloaded.name] = dataclasses.replace(runtime, model=reloaded)
            flags += [(await _classify(client, body))["cached"] for _ in range(2)]
            return flags
    finally:
        await asyncio.to_thread(engine.stop)
        state.pool.shutdown()
        state.decoder.close()
        if state.cache is not None:
            state.cache.close()


def test_new_weights_fingerprint_misses_the_cache(tmp_path: Path) -> None:
    first, second, after_change, again = asyncio.run(_scenario(tmp_path))
    assert (first, second) == (False, True)  # the cache is on and answers repeats
    assert after_change is False, "an answer computed with the old weights was served"
    assert again is True
