"""What changes when models load and unload on a GPU, on the CUDA stand-in: another
program's memory is subtracted from the budget once, not once per load; and models loaded
on demand between quiet spells are not a leak. Each load here is what the loader does
after a real one: the weights allocated on the device and counted in the probe's baseline,
the runtime installed, the budget computed again from a fresh reading."""

from __future__ import annotations

import time

import torch
from cuda_standin import CudaStandIn, GiB, MiB, StandInForward, install_gpu

from app.config import load_settings
from app.engine.engine import InferenceEngine, MemoryCost, Phase, Runtime
from app.engine.oom import OomRecovery
from app.memory.fit import MemoryFit
from app.memory.guard import MemoryGuard
from app.schemas import MemoryReport

WEIGHTS = 100 * MiB


class Clock:
    """The engine's clock, moved on by hand: quiet spells without waiting for them."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


def engine_on(monkeypatch, tmp_path) -> tuple[InferenceEngine, CudaStandIn, Clock]:
    cuda, _ = install_gpu(monkeypatch, total=8 * GiB, context=200 * MiB)
    clock = Clock()
    engine = InferenceEngine(load_settings(device="cuda", memory_fraction=0.7,
                                           idle_release_s=1, log_dir=tmp_path / "logs",
                                           profile_dir=tmp_path / "profiles"), clock=clock)
    return engine, cuda, clock


WEIGHTS_ON_DEVICE: dict[str, int] = {}


def load(engine: InferenceEngine, cuda: CudaStandIn, name: str) -> None:
    """A model of WEIGHTS bytes, 50 MiB per image, loaded and installed on the stand-in."""
    WEIGHTS_ON_DEVICE[name] = cuda.alloc(WEIGHTS)
    probe = engine.models.the_probe()
    engine.models.set_weights(engine.models.weights_total() + WEIGHTS)  # as calibration does
    probe.set_baseline()
    fit = MemoryFit(0, 50 * MiB)
    guard = MemoryGuard(engine.models.budget_for(probe.read(), engine.models.weights_total()
                                                 + WEIGHTS), fit, max_batch=8)
    recovery = OomRecovery(StandInForward(cuda, 50 * MiB), guard, probe)
    engine.install(Runtime(None, None, probe, guard, recovery,  # type: ignore[arg-type]
                           MemoryCost(WEIGHTS, 0, 0, fit, [(1, 50 * MiB)]), None), name=name)
    engine.models.rebudget()
    engine.phase = Phase.READY


def budget(engine: InferenceEngine) -> int:
    runtime = engine.models.primary
    assert runtime is not None
    return runtime.guard.budget_bytes


def tick(engine: InferenceEngine, clock: Clock, after_s: float = 1.0) -> None:
    clock.now += after_s
    engine.tick()


def test_another_programs_memory_is_subtracted_once_across_loads_and_an_unload(
        monkeypatch, tmp_path):
    engine, cuda, clock = engine_on(monkeypatch, tmp_path)
    load(engine, cuda, "a")
    start = budget(engine)
    cuda.others = GiB  # a game takes 1 GiB
    tick(engine, clock)
    assert budget(engine) == start - GiB
    load(engine, cuda, "b")
    load(engine, cuda, "c")
    tick(engine, clock)
    assert budget(engine) == start - GiB - 2 * WEIGHTS  # not 2 or 3 GiB less
    cuda.free(WEIGHTS_ON_DEVICE.pop("c"))  # what unloading does to the model's tensors
    engine.loader.unload("c", "admin", False)
    tick(engine, clock)
    assert budget(engine) == start - GiB - WEIGHTS
    cuda.others = 2 * GiB  # and then another 1 GiB: counted once more
    tick(engine, clock)
    assert budget(engine) == start - 2 * GiB - WEIGHTS


def idle_report(engine: InferenceEngine, cuda: CudaStandIn, clock: Clock) -> MemoryReport:
    """A batch, then a quiet spell long enough for the idle diagnosis."""
    cuda.forward(50 * MiB)
    engine.upkeep.note_batch(50 * MiB)
    engine.batcher.stats.batches += 1
    tick(engine, clock, after_s=3600)
    assert engine.last_report is not None
    return engine.last_report


def test_models_loaded_on_demand_between_quiet_spells_are_not_a_leak(monkeypatch, tmp_path):
    engine, cuda, clock = engine_on(monkeypatch, tmp_path)
    load(engine, cuda, "a")
    idle_report(engine, cuda, clock)
    for name in ("b", "c", "d"):  # each quiet spell holds 100 MiB more: the new weights
        load(engine, cuda, name)
        report = idle_report(engine, cuda, clock)
        assert not report.leak_suspected and report.leak_growth_bytes == 0
    assert not list((tmp_path / "logs").glob("leak-snapshot-*"))
    # A real leak is still found: 8 MiB more kept at each quiet spell, with no load.
    for _ in range(3):
        cuda.alloc(8 * MiB)
        report = idle_report(engine, cuda, clock)
    assert report.leak_suspected and report.leak_growth_bytes == 3 * 8 * MiB
    assert torch.cuda.memory_allocated() == 4 * WEIGHTS + 3 * 8 * MiB
