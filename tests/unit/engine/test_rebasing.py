"""What changes when models load and unload on a GPU, on the CUDA stand-in: another
program's memory is subtracted from the budget once, not once per load; and models loaded
on demand between quiet spells are not a leak. Each load here is what the loader does
after a real one: the weights allocated on the device and counted in the probe's baseline,
the runtime installed, the budget computed again from a fresh reading."""

from __future__ import annotations

import torch
from cuda_standin import CudaStandIn, GiB, MiB, install_gpu
from standin_engine import WEIGHTS, Clock, budget, engine_for, tick
from standin_engine import load as load_on

from app.engine.engine import InferenceEngine
from app.schemas import MemoryReport


def engine_on(monkeypatch, tmp_path) -> tuple[InferenceEngine, CudaStandIn, Clock]:
    cuda, _ = install_gpu(monkeypatch, total=8 * GiB, context=200 * MiB)
    clock = Clock()
    return engine_for(tmp_path, clock), cuda, clock


WEIGHTS_ON_DEVICE: dict[str, int] = {}


def load(engine: InferenceEngine, cuda: CudaStandIn, name: str) -> None:
    load_on(engine, cuda, name, WEIGHTS_ON_DEVICE)


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


def test_a_warm_cache_is_not_images_in_progress(monkeypatch, tmp_path):
    """Admission counts tensor bytes; so does the watermark state: the cache a big batch
    left (free blocks the next batch reuses) does not make a GPU look full. Counted by
    reserved bytes, as it was, the state went to shedding here."""
    engine, cuda, clock = engine_on(monkeypatch, tmp_path)
    load(engine, cuda, "a")
    runtime = engine.models.primary
    assert runtime is not None
    cuda.forward(5 * GiB)  # a batch came and went: 5 GiB stay cached
    assert cuda.reserved - cuda.allocated >= 5 * GiB > runtime.guard.high_bytes
    tick(engine, clock)
    assert runtime.guard.state.value == "ok" and runtime.guard.usage == 0
    assert runtime.guard.max_batch_now(runtime.probe.in_use()) == runtime.guard.max_batch
