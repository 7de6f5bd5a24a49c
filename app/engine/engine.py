"""The inference engine: one model, one device thread, one batcher.

It loads the model and runs warmup on the device thread (so that thread is
the only one that ever touches the GPU), then serves ``classify`` calls from
the event loop, which only awaits futures.
"""

from __future__ import annotations

import asyncio
import enum
import logging

from app.config import Settings
from app.engine.batcher import MicroBatcher
from app.engine.device import resolve_device
from app.engine.predictor import Prediction, Predictor, Sample
from app.engine.warmup import WarmupProfile, profile
from app.errors import NotReady
from app.models import LoadedModel, load_model

log = logging.getLogger("vramguard.engine")
GPU_DEFAULT_WAIT_S = 0.002


class Phase(enum.StrEnum):
    STARTING = "starting"
    LOADING = "loading"
    WARMING_UP = "warming_up"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


class InferenceEngine:
    """Owns the model and the batcher; ``start`` must finish before ``classify`` works."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.phase = Phase.STARTING
        self.error: str | None = None
        self.model: LoadedModel | None = None
        self.predictor: Predictor | None = None
        self.warmup: WarmupProfile | None = None
        wait_s = settings.max_wait_ms / 1000 if settings.max_wait_ms is not None else (
            GPU_DEFAULT_WAIT_S if self.device.type == "cuda" else 0.0)
        self.batcher: MicroBatcher[Sample, Prediction] = MicroBatcher(
            self._run_batch, max_batch=1, max_wait_s=wait_s, queue_size=settings.queue_size)

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    async def start(self) -> None:
        """Load the model and run warmup on the device thread; record any failure."""
        self.batcher.start()
        try:
            self.phase = Phase.LOADING
            self.model = await asyncio.wrap_future(self.batcher.call(self._load))
            self.phase = Phase.WARMING_UP
            self.warmup = await asyncio.wrap_future(self.batcher.call(self._profile))
        except Exception as exc:
            self.phase = Phase.FAILED
            self.error = str(exc) or type(exc).__name__
            log.exception("model %s could not start", self.settings.model)
            return
        self.batcher.set_max_batch(self.warmup.chosen_batch_size)
        self.batcher.set_service_rate(self.warmup.images_per_second)
        self.phase = Phase.READY
        log.info("ready: %s on %s, batch size %d (%.1f images/s), warmup %.1f s",
                 self.model.name, self.device, self.warmup.chosen_batch_size,
                 self.warmup.images_per_second, self.warmup.duration_s)

    def stop(self) -> None:
        self.phase = Phase.STOPPED
        self.batcher.stop()

    async def classify(self, sample: Sample) -> Prediction:
        """Queue one preprocessed image; raises Overloaded / DeadlineExceeded when busy."""
        if not self.ready:
            raise NotReady(self.not_ready_message(), retry_after=5)
        return await self.batcher.infer(sample, self.settings.request_timeout_s)

    def not_ready_message(self) -> str:
        if self.phase is Phase.FAILED:
            return f"The model could not be started: {self.error}"
        return "vramguard is still starting up (loading and warming up the model)."

    # -- on the device thread --------------------------------------------------------------

    def _load(self) -> LoadedModel:
        model = load_model(self.settings.model, self.device, self.settings.weights)
        self.predictor = Predictor(model, keep_all=self.settings.cache)
        return model

    def _profile(self) -> WarmupProfile:
        assert self.predictor is not None
        predictor = self.predictor
        return profile(lambda size: predictor(predictor.random_batch(size)),
                       self.settings.max_batch_size, self.settings.target_latency_ms / 1000)

    def _run_batch(self, samples: list[Sample]) -> list[Prediction]:
        assert self.predictor is not None
        return self.predictor(samples)
