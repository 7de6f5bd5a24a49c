"""From the moment /readyz says ready, /metrics has every memory series: the real model
starts in-process, and no memory-monitor tick runs before the scrape."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from app.config import load_settings
from app.http.server import create_app
from app.observe.registry import MEMORY_GAUGES, OOM_COUNTERS

PORT = 8765


async def first_scrape_after_ready(tmp_path: Path) -> tuple[int, str]:
    settings = load_settings(port=PORT, token_file=tmp_path / "admin-token", cache=False,
                             max_batch_size=2)
    app = create_app(settings)  # no lifespan here: the monitor never ticks
    engine = app.state.vg.engine
    await engine.start()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport,
                                     base_url=f"http://127.0.0.1:{PORT}") as client:
            ready = (await client.get("/readyz")).status_code
            return ready, (await client.get("/metrics")).text
    finally:
        await asyncio.to_thread(engine.stop)


def test_every_memory_series_is_there_from_the_first_scrape_after_ready(tmp_path):
    ready, text = asyncio.run(first_scrape_after_ready(tmp_path))
    assert ready == 200
    families = {family.name for family in text_string_to_metric_families(text)}
    expected = {f"vramguard_{name}" for name in (*MEMORY_GAUGES, *OOM_COUNTERS)}
    assert expected | {"vramguard_memory_state"} <= families
