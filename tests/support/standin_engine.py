"""Engines on the CUDA stand-in, and models installed on them without a real model: each
load is what the loader does after a real one (the weights allocated on the device and
counted in the probe's baseline, the runtime installed, the budget computed again from a
fresh reading). The engine's clock is moved on by hand: quiet spells without waiting."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from cuda_standin import CudaStandIn, MiB, StandInForward

from app.config import load_settings
from app.engine.engine import InferenceEngine, MemoryCost, Phase, Runtime
from app.engine.oom import OomRecovery
from app.memory.fit import MemoryFit
from app.memory.guard import MemoryGuard

WEIGHTS = 100 * MiB
PER_IMAGE = 50 * MiB


class Clock:
    """The engine's clock, moved on by hand."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


def engine_for(folder: Path, clock: Clock, **kwargs: Any) -> InferenceEngine:
    """An engine on the installed stand-in: its logs and profiles under ``folder``;
    ``kwargs``: settings, and ``sharing`` (the engine's sharing factory)."""
    sharing = kwargs.pop("sharing", None)
    settings = load_settings(**{"device": "cuda", "memory_fraction": 0.7,
                                "idle_release_s": 1, "log_dir": folder / "logs",
                                "profile_dir": folder / "profiles", **kwargs})
    extra = {} if sharing is None else {"sharing": sharing}
    return InferenceEngine(settings, clock=clock, **extra)


def load(engine: InferenceEngine, cuda: CudaStandIn, name: str,
         placed: dict[str, int] | None = None, pinned: bool = True) -> None:
    """A model of WEIGHTS bytes, PER_IMAGE per image, loaded and installed on the stand-in
    (kept loaded, unless not ``pinned``); its weights' handle kept in ``placed``."""
    handle = cuda.alloc(WEIGHTS)
    if placed is not None:
        placed[name] = handle
    probe = engine.models.the_probe()
    engine.models.set_weights(engine.models.weights_total() + WEIGHTS)  # as calibration does
    probe.set_baseline()
    fit = MemoryFit(0, PER_IMAGE)
    guard = MemoryGuard(engine.models.budget_for(probe.read(), engine.models.weights_total()
                                                 + WEIGHTS), fit, max_batch=8)
    recovery = OomRecovery(StandInForward(cuda, PER_IMAGE), guard, probe)
    engine.install(Runtime(None, None, probe, guard, recovery,  # type: ignore[arg-type]
                           MemoryCost(WEIGHTS, 0, 0, fit, [(1, PER_IMAGE)]), None),
                   pinned=pinned, name=name)
    engine.models.rebudget()  # the budget and the allocator's limit, as the loader's
    engine.phase = Phase.READY


def budget(engine: InferenceEngine) -> int:
    runtime = engine.models.primary
    assert runtime is not None
    return runtime.guard.budget_bytes


def tick(engine: InferenceEngine, clock: Clock, after_s: float = 1.0) -> None:
    clock.now += after_s
    engine.tick()
