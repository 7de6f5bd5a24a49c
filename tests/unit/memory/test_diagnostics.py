"""Memory diagnostics: the leak rule (with numbers, then on the CPU analogue with tensors
really held between idle periods), fragmentation and the leak snapshot (on the CUDA
stand-in: the CPU has no allocator cache), large allocations caught with their stack,
GPU utilisation as a GPU-only series, the device-level alert rules, and what the tray
says about it all."""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from asgi import anyio_backend, built_app, client, parse, state_of  # noqa: F401  (a fixture)
from cuda_messages import cuda_runtime_error
from cuda_standin import CudaStandIn, GiB, MiB, StandInForward, install_gpu
from samples import sample as live_sample
from tiny_model import tiny_model

from app.config import load_settings
from app.engine.engine import InferenceEngine, MemoryCost, Phase, Runtime
from app.engine.oom import OomRecovery
from app.engine.predictor import Prediction, Sample
from app.errors import NotReady
from app.memory.budget import Budget
from app.memory.diagnostics import (
    LEAK_RISES,
    MemoryDiagnostics,
    cache_verdict,
    leak_check_verdict,
)
from app.memory.fit import MemoryFit
from app.memory.guard import MemoryGuard
from app.memory.probes import CudaProbe
from app.observe.registry import GPU_ONLY_SERIES
from app.schemas import MemoryReport
from tray.client import ApiClient
from tray.controller import TrayController
from tray.text import Notifier, menu_lines, tooltip

ALERTS = Path(__file__).resolve().parents[3] / "assets" / "monitoring" / "alerts.yml"
WEIGHTS = 100 * MiB


# -- the leak rule, with numbers -------------------------------------------------------------


def test_leak_is_suspected_after_three_rises_without_a_fall_and_cleared_when_memory_is_back():
    diagnostics = MemoryDiagnostics(warm_allocated=WEIGHTS)
    levels = [WEIGHTS + n * MiB for n in (2, 2, 4, 4, 7)]  # a flat spell keeps the count
    raised = [diagnostics.idle(level, level).leak_raised for level in levels]
    assert raised == [False, False, False, False, True]
    assert diagnostics.leak_suspected and diagnostics.leak_growth == 7 * MiB
    assert list(diagnostics.baselines) == levels
    diagnostics.idle(WEIGHTS + 3 * MiB, WEIGHTS + 3 * MiB)  # partly given back: still held
    assert diagnostics.leak_suspected and diagnostics.leak_growth == 3 * MiB
    diagnostics.idle(WEIGHTS, WEIGHTS)
    assert not diagnostics.leak_suspected and diagnostics.leak_growth == 0


def test_a_fall_restarts_the_count_and_small_moves_are_not_rises():
    diagnostics = MemoryDiagnostics(warm_allocated=WEIGHTS)
    for level in (WEIGHTS + 4 * MiB, WEIGHTS + 8 * MiB, WEIGHTS + 2 * MiB, WEIGHTS + 6 * MiB,
                  WEIGHTS + 6 * MiB + 1000, WEIGHTS + 6 * MiB + 2000):
        diagnostics.idle(level, level)
    assert not diagnostics.leak_suspected


def test_fragmentation_is_split_free_space_not_a_large_cache():
    """A warm GPU caches many times its weights (the old rule, reserved >= 5 x allocated,
    called that fragmented); what is fragmented is free space split between live blocks."""
    diagnostics = MemoryDiagnostics(warm_allocated=WEIGHTS)
    assert not diagnostics.idle(WEIGHTS, 10 * WEIGHTS, inactive_split=0).fragmented
    assert not diagnostics.idle(WEIGHTS, 4 * WEIGHTS, inactive_split=2 * WEIGHTS - 1).fragmented
    assert diagnostics.idle(WEIGHTS, 4 * WEIGHTS, inactive_split=2 * WEIGHTS).fragmented
    assert not diagnostics.idle(MiB, 100 * MiB, inactive_split=63 * MiB).fragmented  # rounding
    assert diagnostics.fragmentation_releases == 1


def test_doctor_lines():
    assert "cannot fragment" in cache_verdict("cpu", WEIGHTS, WEIGHTS, 0)
    assert "fragmented" in cache_verdict("cuda:0", WEIGHTS, 6 * WEIGHTS, 4 * WEIGHTS)
    assert "cannot give that part back" in cache_verdict("cuda:0", WEIGHTS, 6 * WEIGHTS,
                                                         4 * WEIGHTS)
    fine = cache_verdict("cuda:0", WEIGHTS, 9 * WEIGHTS, 0)
    assert fine.startswith("900 MiB held for 100 MiB in use") and ": fine" in fine
    assert "cpu_memory_cap" in leak_check_verdict(tracked=False, idle_s=60)
    assert f"{LEAK_RISES} times" in leak_check_verdict(tracked=True, idle_s=60)


# -- the leak rule on the CPU analogue -------------------------------------------------------


def image() -> Sample:
    return Sample(torch.rand(3, 16, 16), top_k=1)


@pytest.fixture
def cpu_engine(tmp_path: Path) -> Iterator[InferenceEngine]:
    """The tiny real model on the CPU with the live-tensor tracker on (a cap far above
    anything it needs), diagnosed at every idle period (a 1 ms quiet spell)."""
    engine = InferenceEngine(load_settings(device="cpu", cache=False, max_batch_size=1,
                                           cpu_memory_cap="1GiB", idle_release_s=0.001,
                                           log_dir=tmp_path / "logs"))
    engine.warm_up(tiny_model())
    engine.phase = Phase.READY
    engine.batcher.start()
    yield engine
    engine.batcher.stop()


def quiet_spell(engine: InferenceEngine) -> MemoryReport:
    """One request, then a quiet spell: the monitor's tick finds the engine idle."""
    assert isinstance(engine.batcher.submit(image(), 10).result(10), Prediction)
    engine.batcher.call(engine.tick).result(10)
    assert engine.last_report is not None
    return engine.last_report


def test_tensors_held_between_idle_periods_raise_the_leak_flag(cpu_engine, caplog):
    """A forward hook that keeps each batch's activations (a classic leak): the tracker
    sees them stay alive, every idle period finds more in use, and the third rise raises
    the flag. Letting go of them brings it down."""
    kept: list[torch.Tensor] = []
    conv = cpu_engine.runtime.model.module[0]
    hook = conv.register_forward_hook(lambda m, i, out: kept.append(out.repeat(512, 1, 1, 1)))
    per_batch = 512 * 4 * 14 * 14 * 4  # 1.5 MiB kept per image
    warm = cpu_engine.batcher.call(cpu_engine.memory_report).result(10).allocated_bytes
    with caplog.at_level(logging.WARNING, logger="vramguard.engine"):
        reports = [quiet_spell(cpu_engine) for _ in range(LEAK_RISES)]
    assert [r.leak_suspected for r in reports] == [False] * (LEAK_RISES - 1) + [True]
    assert reports[-1].leak_growth_bytes == pytest.approx(LEAK_RISES * per_batch, abs=1024)
    assert reports[-1].idle_baselines_bytes == pytest.approx(
        [warm + n * per_batch for n in range(1, LEAK_RISES + 1)], abs=1024)
    assert reports[-1].state.value == "ok"  # a leak does not change the guard's state
    assert "possible memory leak" in caplog.text
    hook.remove()
    kept.clear()
    released = quiet_spell(cpu_engine)
    assert not released.leak_suspected and released.leak_growth_bytes < 1024


def test_no_leak_when_nothing_is_kept(cpu_engine):
    reports = [quiet_spell(cpu_engine) for _ in range(LEAK_RISES + 2)]
    assert not any(r.leak_suspected for r in reports)
    assert len(set(reports[-1].idle_baselines_bytes)) == 1


# -- large allocations -----------------------------------------------------------------------


def large_allocation_engine(tmp_path: Path, limit: str) -> InferenceEngine:
    engine = InferenceEngine(load_settings(device="cpu", cache=False, max_batch_size=1,
                                           cpu_memory_cap="1GiB", large_allocation_bytes=limit,
                                           log_dir=tmp_path / "logs"))
    engine.warm_up(tiny_model())
    engine.phase = Phase.READY
    return engine


def allocate_4_mib_in_the_forward_pass(module, inputs, output):
    """Not in the model at warmup: a 4 MiB temporary the profile knows nothing of."""
    return output + output.repeat(1340, 1, 1, 1).sum(dim=0, keepdim=True) * 0


@pytest.mark.parametrize(("limit", "depths", "logged"), [("1MiB", [1, 2, 1], 1),
                                                         ("0", [1, 1, 1], 0)])
def test_a_large_allocation_beyond_the_expected_peak_is_logged_once_with_its_stack(
        tmp_path, caplog, limit, depths, logged):
    """The first batch only measures (its peak is read anyway); the next one of that size
    runs under the dispatch mode and names the code; later ones cost nothing again. With
    the setting at 0 no mode but the CPU's tracker is ever entered."""
    engine = large_allocation_engine(tmp_path, limit)
    seen: list[int] = []
    conv = engine.runtime.model.module[0]
    conv.register_forward_hook(allocate_4_mib_in_the_forward_pass)
    conv.register_forward_pre_hook(
        lambda m, i: seen.append(torch._C._len_torch_dispatch_stack()))
    engine.batcher.start()
    try:
        with caplog.at_level(logging.WARNING, logger="vramguard.memory"):
            for _ in range(3):
                assert isinstance(engine.batcher.submit(image(), 10).result(10), Prediction)
        report = engine.batcher.call(engine.memory_report).result(10)
    finally:
        engine.batcher.stop()
    assert seen == depths  # 1: the tracker; 2: the tracker and the watch
    assert report.large_allocations == logged
    lines = [r.getMessage() for r in caplog.records if "Large allocation" in r.getMessage()]
    assert len(lines) == logged
    if logged:
        assert "4 MiB" in lines[0] and "allocate_4_mib_in_the_forward_pass" in lines[0]


# -- the CUDA stand-in: fragmentation, the leak snapshot, utilisation ------------------------


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """Returns a function making an engine on the stand-in GPU (the real batcher, guard,
    OOM recovery and CUDA probe; a forward pass of 100 MiB per image), and the stand-ins."""
    cuda, nvml = install_gpu(monkeypatch, total=8 * GiB, context=200 * MiB)
    cuda.alloc(WEIGHTS)
    engines: list[InferenceEngine] = []

    def make(**settings: object) -> InferenceEngine:
        engine = InferenceEngine(load_settings(device="cuda", log_dir=tmp_path / "logs",
                                               **settings), clock=QUIET)
        probe = CudaProbe(torch.device("cuda", 0), WEIGHTS)
        fit = MemoryFit(0, 100 * MiB)
        guard = MemoryGuard(Budget(8 * GiB, 1.0, WEIGHTS, 0, cap=2 * GiB + WEIGHTS), fit,
                            max_batch=8)
        recovery = OomRecovery(StandInForward(cuda, 100 * MiB), guard, probe)
        engine.install(Runtime(None, None, probe, guard, recovery,  # type: ignore[arg-type]
                               MemoryCost(WEIGHTS, 0, 0, fit, [(1, 100 * MiB)]), None),
                       name="stand-in")
        engine.phase = Phase.READY
        engine.batcher.start()
        engines.append(engine)
        return engine

    yield make, cuda, nvml
    for engine in engines:
        engine.batcher.stop()


class QuietClock:
    """The engine's clock, moved on by hand: a quiet spell without waiting for it."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


QUIET = QuietClock()


def serve_then_idle(engine: InferenceEngine, images: int,
                    between: Callable[[], object] = lambda: None) -> MemoryReport:
    """``images`` requests at once, ``between()``, then a tick long after them (a quiet
    spell)."""
    futures = [engine.batcher.submit(image(), 10) for _ in range(images)]
    assert all(isinstance(f.result(10), Prediction) for f in futures)
    between()
    QUIET.now += 3600  # an hour of quiet, without waiting for it
    engine.batcher.call(engine.tick).result(10)
    assert engine.last_report is not None
    return engine.last_report


def keep_small_blocks(cuda: CudaStandIn, count: int) -> Callable[[], list[int]]:
    """Something keeps ``count`` 1 MiB tensors made after a batch: each lands in one of the
    batch's cached 100 MiB segments and splits it (99 MiB free beside a live block)."""
    return lambda: [cuda.alloc(MiB) for _ in range(count)]


def test_a_warm_cache_is_kept_and_a_fragmented_one_emptied_with_idle_release_off(gpu):
    make, cuda, _ = gpu
    engine = make(idle_release_s=0)
    warm = serve_then_idle(engine, 8)  # 900 MiB held for 100 MiB in use: a warm cache
    assert cuda.reserved == 9 * WEIGHTS
    assert (warm.idle_releases, warm.fragmentation_releases) == (0, 0)
    kept: list[int] = []
    report = serve_then_idle(engine, 1, lambda: kept.extend(keep_small_blocks(cuda, 8)()))
    assert cuda.memory_stats()["inactive_split_bytes.all.current"] == 8 * 99 * MiB
    assert (report.idle_releases, report.fragmentation_releases) == (1, 1)
    # Emptying it returned the one wholly free segment, not the split ones.
    assert cuda.reserved == 9 * WEIGHTS
    for handle in kept:
        cuda.free(handle)
    assert serve_then_idle(engine, 1).fragmentation_releases == 1  # mended once freed


def test_idle_release_counts_the_fragmented_ones(gpu):
    make, cuda, _ = gpu
    engine = make(idle_release_s=1)
    assert serve_then_idle(engine, 1).fragmentation_releases == 0
    assert cuda.reserved == WEIGHTS  # released all the same: the setting asks for it
    report = serve_then_idle(engine, 6, keep_small_blocks(cuda, 5))
    assert (report.idle_releases, report.fragmentation_releases) == (2, 1)


def test_a_leak_on_cuda_writes_one_allocator_snapshot_with_stacks(gpu, tmp_path):
    """Blocks held between idle periods: from the first rise the allocator records the
    Python stacks of live blocks; at the flag one snapshot goes to the log folder and the
    recording stops; later rises write no more."""
    make, cuda, _ = gpu
    engine = make(idle_release_s=1)
    serve_then_idle(engine, 1)  # the warm level is the weights
    for spell in range(LEAK_RISES + 1):
        cuda.alloc(8 * MiB)  # something keeps 8 MiB per quiet spell
        report = serve_then_idle(engine, 1)
        if spell == 0:
            assert cuda.recording and cuda.history[-1]["stacks"] == "python"
    assert report.leak_suspected and report.leak_growth_bytes == (LEAK_RISES + 1) * 8 * MiB
    snapshots = list((tmp_path / "logs").glob("leak-snapshot-*.pickle"))
    assert len(snapshots) == 1
    assert pickle.loads(snapshots[0].read_bytes())["segments"]
    assert not cuda.recording and cuda.history[-1]["enabled"] is None


def test_a_gpu_lost_in_the_monitors_tick_fails_the_engine(gpu, monkeypatch):
    """A GPU off the bus (CUDA's 999) surfaces first where the monitor reads the device's
    memory: the engine must stop saying ready, as for a sticky error in a batch."""
    make, _, nvml = gpu
    engine = make()
    nvml.fail("nvmlDeviceGetMemoryInfo")  # NVML first, then CUDA's own figure: both gone

    def lost(device: object = None) -> tuple[int, int]:
        raise cuda_runtime_error(999)

    monkeypatch.setattr(torch.cuda, "mem_get_info", lost)
    assert engine.batcher.call(engine.tick).result(10) is None
    assert engine.health.device_lost and engine.phase is Phase.FAILED
    assert engine.health.error == "CUDA error: unknown error"


def test_a_gpu_lost_while_emptying_the_cache_after_an_oom_fails_the_engine(gpu, monkeypatch):
    """The synchronize in the OOM recovery's ``empty_cache`` is where a sticky error from
    the failed batch's kernels arrives: 503 and a failed engine, not a 500 while ready."""
    make, cuda, _ = gpu
    engine = make()
    cuda.fail_next_alloc()

    def lost(device: object = None) -> None:
        raise cuda_runtime_error(700)

    monkeypatch.setattr(torch.cuda, "synchronize", lost)
    answer = engine.batcher.submit(image(), 10)
    with pytest.raises(NotReady):
        answer.result(10)
    assert engine.health.device_lost and "illegal memory access" in str(engine.health.error)


FLATTENED = ("memory_stats", "memory_allocated", "memory_reserved", "max_memory_allocated",
             "max_memory_reserved")


def test_a_batch_reads_the_allocators_figures_once_per_phase(gpu):
    """Each flattened read (torch.cuda.memory_allocated and its kin) builds and sorts every
    figure, 0.3-0.5 ms against 3-5 ms for a batch of one: a batch reads only the nested form
    (6 times: its size; the OOM count; the peak restarted; the large-allocation watch
    before and after; peak and held after it)."""
    make, cuda, _ = gpu
    engine = make()
    assert isinstance(engine.batcher.submit(image(), 10).result(10), Prediction)
    cuda.calls.clear()
    assert isinstance(engine.batcher.submit(image(), 10).result(10), Prediction)
    assert not {name: cuda.calls[name] for name in FLATTENED if cuda.calls[name]}
    assert cuda.calls["memory_stats_as_nested_dict"] <= 6


def test_the_memory_report_lists_the_other_programs_on_the_gpu(gpu):
    """/v1/memory (and so the dashboard and the tray, which read its figures): who took
    the memory, by name; here the parent of this test process holds 2 GiB."""
    make, _, nvml = gpu
    parent = os.getppid()
    nvml.graphics_processes = {parent: 2 * GiB}
    engine = make()
    report = engine.batcher.call(engine.memory_report).result(10)
    assert [(p.pid, p.name, p.used_bytes) for p in report.other_programs] == [
        (parent, psutil.Process(parent).name(), 2 * GiB)]


def test_gpu_utilisation_comes_from_nvml(gpu):
    make, _, nvml = gpu
    nvml.utilization = (97, 40)
    engine = make()
    report = engine.batcher.call(engine.memory_report).result(10)
    assert report.gpu_utilization_ratio == pytest.approx(0.97)
    nvml.fail("nvmlDeviceGetUtilizationRates")
    assert engine.batcher.call(engine.memory_report).result(10).gpu_utilization_ratio is None


# -- /metrics and the alert rules ------------------------------------------------------------


def gpu_report(**changes: object) -> MemoryReport:
    fields = {name: 0 for name, field in MemoryReport.model_fields.items()
              if field.is_required()}
    return MemoryReport.model_validate(fields | {
        "device": "cuda:0", "source": "nvml", "nvml": True, "state": "ok",
        "profile_points": [], "cpu_memory_cap_bytes": None, "process_used_bytes": None,
        **changes})


@pytest.mark.anyio
async def test_gpu_only_series_are_absent_on_the_cpu_and_present_on_a_gpu(tmp_path):
    with built_app(tmp_path) as app:
        engine = state_of(app).engine
        async with client(app) as http:
            engine.last_report = gpu_report(device="cpu", source="cpu", nvml=False)
            cpu = parse((await http.get("/metrics")).text)
            engine.last_report = gpu_report(gpu_utilization_ratio=0.42, leak_suspected=True,
                                            leak_growth_bytes=12 * MiB,
                                            fragmentation_releases=3, large_allocations=2)
            gpu = parse((await http.get("/metrics")).text)
    names = {name for name, _ in cpu}
    assert not GPU_ONLY_SERIES & names
    assert {"vramguard_leak_suspected", "vramguard_fragmentation_releases_total"} <= names
    assert gpu[("vramguard_gpu_utilization_ratio", ())] == 0.42
    assert gpu[("vramguard_leak_suspected", ())] == 1
    assert gpu[("vramguard_leak_growth_bytes", ())] == 12 * MiB
    assert gpu[("vramguard_fragmentation_releases_total", ())] == 3
    assert gpu[("vramguard_large_allocations_total", ())] == 2


def test_the_two_standard_device_level_alerts_are_shipped():
    rules = {rule["alert"]: rule for group in yaml.safe_load(ALERTS.read_text())["groups"]
             for rule in group["rules"]}
    memory = rules["VramguardDeviceMemoryAbove90Percent"]
    assert memory["expr"] == ("vramguard_device_memory_used_bytes / "
                              "vramguard_device_memory_total_bytes > 0.9")
    assert (memory["for"], memory["labels"]["severity"]) == ("2m", "critical")
    busy = rules["VramguardGpuUtilizationAbove95Percent"]
    assert busy["expr"] == "vramguard_gpu_utilization_ratio > 0.95" and busy["for"] == "5m"
    assert "VramguardMemoryAboveHighWatermark" in rules  # the budget-relative ones stay


# -- the tray ---------------------------------------------------------------------------------


def test_tray_shows_gpu_utilisation_and_a_suspected_leak():
    busy = live_sample(gpu_utilization_ratio=0.4, leak_suspected=True,
                       leak_growth_bytes=12 * MiB)
    assert tooltip(busy) == "vramguard: healthy, 41% of the limit used, peak 63%, GPU 40% busy"
    lines = menu_lines(busy)
    assert "GPU busy: 40% of the time (all programs)" in lines
    assert "Possible leak: 12 MiB more kept than at start" in lines
    assert tooltip(live_sample()) == "vramguard: healthy, 41% of the limit used, peak 63%"


def test_a_leak_is_notified_once_per_episode():
    notifier = Notifier()
    seen = [notifier.leak(suspected, 12 * MiB) for suspected in (False, True, True, False, True)]
    assert [bool(m) for m in seen] == [False, True, False, False, True]
    assert "12 MiB" in str(seen[1]) and "Restarting vramguard" in str(seen[1])


def test_the_tray_notifies_a_leak_without_changing_colour(tmp_path):
    messages: list[str] = []
    tray = TrayController(ApiClient("http://127.0.0.1:9", tmp_path / "token"), messages.append)
    for _ in range(3):
        tray.stream_sample(live_sample(leak_suspected=True, leak_growth_bytes=5 * MiB))
    leaks = [message for message in messages if "keeps" in message]  # after "is ready"
    assert len(leaks) == 1 and "5 MiB" in leaks[0]
    assert tray.tooltip().startswith("vramguard: healthy")
    tray.client.close()
