"""In-process HTTP tests: the real app, un-started (no model load), behind httpx's
ASGITransport; a stand-in engine that says it is ready; the JSON error shape.

The lifespan (model load, memory monitor) is not run by ASGITransport, so
``create_app(settings)`` gives the real gates, routes and error mapping with an
engine in its ``starting`` phase.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from fastapi import FastAPI
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from app.config import Settings, load_settings
from app.engine.engine import InferenceEngine, MemoryCost, Phase, Runtime
from app.engine.lanes import Reservation
from app.engine.oom import OomRecovery
from app.engine.predictor import Prediction, Predictor, Ranked, Sample
from app.engine.warmup import WarmupTimings
from app.http.server import create_app
from app.http.state import AppState
from app.memory.budget import Budget
from app.memory.fit import MemoryFit
from app.memory.guard import MemoryGuard
from app.memory.probes import CpuProbe
from app.models import LoadedModel
from app.preprocessing import Preprocessing

PORT = 8765
BASE_URL = f"http://127.0.0.1:{PORT}"
PEER = ("127.0.0.1", 50000)
LABELS = [f"class-{i}" for i in range(10)]
WARMUP_S = 1.25


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """Run ``@pytest.mark.anyio`` tests on asyncio only (trio is installed, the app is not
    written for it)."""
    return "asyncio"


def make_settings(tmp_path: Path, **overrides: Any) -> Settings:
    """Settings for an in-process app: port 8765, CPU, no result cache, a private token."""
    values: dict[str, Any] = {"port": PORT, "token_file": tmp_path / "admin-token",
                              "cache": False, "cache_dir": tmp_path / "cache",
                              "device": "cpu", "decode_workers": 2}
    return load_settings(**{**values, **overrides})


def stand_in_runtime(model: LoadedModel) -> Runtime:
    """A real runtime around ``model`` with figures set by hand (no warmup, no device):
    what the engine's view reads of a loaded model."""
    fit = MemoryFit(0, 1)
    probe = CpuProbe(0, None)
    guard = MemoryGuard(Budget(total=2**30, fraction=1.0, weights=0, overhead=0), fit,
                        max_batch=1)
    predictor = Predictor(model, keep_all=False)
    return Runtime(model, predictor, probe, guard, OomRecovery(predictor, guard, probe),
                   MemoryCost(0, 0, 0, fit, [(1, 0)]),
                   WarmupTimings(chosen_batch_size=1, duration_s=WARMUP_S))


class ReadyEngine(InferenceEngine):
    """A real engine object that reports itself ready with a stand-in model (no weights,
    no device thread); ``classify`` ranks the classes in reverse order without a
    forward pass and keeps the samples it was given."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        model = LoadedModel(name=settings.model, module=torch.nn.Identity(), labels=LABELS,
                            preprocessing=Preprocessing(resize=32, crop=32,
                                                        mean=(0.0, 0.0, 0.0),
                                                        std=(255.0, 255.0, 255.0)),
                            weights_file=Path("stand-in.pt"), weights_version="stand-in",
                            device=torch.device("cpu"))
        # Loaded by hand, not installed: a lane, never run (no device thread), for
        # admission to count places in.
        self.runtimes[model.name] = stand_in_runtime(model)
        self.batcher.add_lane(model.name, lambda samples: [])
        self.phase = Phase.READY
        self.samples: list[Sample] = []

    async def classify(self, sample: Sample, timeout_s: float,
                       reservation: Reservation | None = None,
                       model: str | None = None) -> Prediction:
        self.samples.append(sample)
        order = np.arange(len(LABELS))[::-1].copy()
        scores = np.linspace(0.5, 0.05, len(LABELS), dtype=np.float32)
        return Prediction(Ranked(order, scores), batch_size=1)


@contextmanager
def built_app(tmp_path: Path, *, ready: bool = False, **overrides: Any) -> Iterator[FastAPI]:
    """The real app (not started); with ``ready`` its engine is a ReadyEngine. Its CPU pool,
    decode processes and result cache are closed afterwards (the lifespan, which would, does
    not run)."""
    settings = make_settings(tmp_path, **overrides)
    app = create_app(settings, ReadyEngine(settings) if ready else None)
    try:
        yield app
    finally:
        state = state_of(app)
        state.pool.shutdown()
        state.decoder.close()
        if state.cache is not None:
            state.cache.close()


def png(size: int = 8) -> bytes:
    """A small valid PNG."""
    out = io.BytesIO()
    Image.new("RGB", (size, size), (200, 30, 30)).save(out, "PNG")
    return out.getvalue()


Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Series:
    """Every sample of a Prometheus text page, by name and sorted labels."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(series: Series, name: str, **labels: str) -> float:
    """One sample's value (KeyError when the page lacks it)."""
    return series[(name, tuple(sorted(labels.items())))]


def state_of(app: FastAPI) -> AppState:
    state = app.state.vg
    assert isinstance(state, AppState)
    return state


def client(app: Callable[..., Any], *, base_url: str = BASE_URL,
           peer: tuple[str, int] = PEER, raise_app_exceptions: bool = True
           ) -> httpx.AsyncClient:
    """An httpx client that calls ``app`` in-process as if from ``peer``."""
    transport = httpx.ASGITransport(app=app, client=peer,
                                    raise_app_exceptions=raise_app_exceptions)
    return httpx.AsyncClient(transport=transport, base_url=base_url, timeout=10)


def error_message(response: httpx.Response, status: int, code: str) -> str:
    """Assert the documented error answer (status, JSON ``{"error": {"code", "message"}}``
    and nothing else); return the message."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message"}, body
    assert body["error"]["code"] == code, body
    message = body["error"]["message"]
    assert isinstance(message, str) and message.strip()
    return message


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait (bounded) until ``predicate()`` holds, yielding to the event loop meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {predicate}")
        await asyncio.sleep(0.002)
