"""The CUDA probe and NVML reader against the scripted stand-in (tests/cuda_standin.py).

The CPU analogue cannot show these: its probe resets the peak per forward pass
by construction, it has no NVML, and its reserved equals its allocated.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
import torch
from cuda_standin import GiB, MiB, StandInForward, install_gpu

from app.config import Settings
from app.engine.engine import InferenceEngine, MemoryCost, Phase, Runtime
from app.engine.oom import OomRecovery
from app.engine.predictor import Prediction, Sample
from app.memory.budget import Budget
from app.memory.fit import MemoryFit
from app.memory.guard import GuardState, MemoryGuard
from app.memory.probes import CpuProbe, CudaProbe

WEIGHTS = 100 * MiB
PER_IMAGE = 100 * MiB
DEVICE = torch.device("cuda", 0)


def sample() -> Sample:
    return Sample(torch.zeros(1), top_k=1)


@pytest.fixture
def serving(monkeypatch):
    """An engine on the stand-in GPU: the real batcher, guard, OOM recovery and CUDA probe;
    only the model is replaced (its forward pass allocates on the stand-in).

    Budget 1 GiB: low 768 MiB, high ~922 MiB; profiled at 100 MiB per image (9 fit).
    """
    cuda, _nvml = install_gpu(monkeypatch, total=4 * GiB, context=200 * MiB)
    cuda.alloc(WEIGHTS)
    engine = InferenceEngine(Settings(device="cuda", idle_release_s=0))
    probe = CudaProbe(DEVICE, WEIGHTS)
    fit = MemoryFit(0, PER_IMAGE)
    guard = MemoryGuard(Budget(4 * GiB, 1.0, WEIGHTS, 0, cap=GiB + WEIGHTS), fit, max_batch=8)
    forward = StandInForward(cuda, PER_IMAGE)
    memory = MemoryCost(WEIGHTS, 0, 0, fit, [(1, PER_IMAGE)])
    engine.install(Runtime(None, None, probe, guard, OomRecovery(forward, guard, probe),
                           memory, None), name="stand-in")  # type: ignore[arg-type]
    engine.phase = Phase.READY
    probe.reset_peak()
    engine.batcher.start()
    yield engine, cuda, forward
    engine.batcher.stop()


def serve(engine: InferenceEngine, images: int) -> list[Prediction]:
    """Queue ``images`` requests while the device thread is held, so they form one batch
    (as far as the guard allows) however slow this machine is, and wait for every answer."""
    gate = threading.Event()
    held = engine.batcher.call(gate.wait)
    futures = [engine.batcher.submit(sample(), 10) for _ in range(images)]
    gate.set()
    held.result(10)
    return [future.result(10) for future in futures]


def tick(engine: InferenceEngine) -> None:
    """What the memory monitor does once a second."""
    assert engine.batcher.call(engine.tick).result(10) is not None


def test_guard_returns_to_ok_after_one_big_batch(serving):
    """One batch far worse than profiled sends the guard to shedding; once load drops,
    small batches bring it back to ok (the CUDA peak is per batch, not since warmup)."""
    engine, _cuda, forward = serving
    guard = engine.runtime.guard
    forward.per_image = 120 * MiB  # reality worse than measured: 8 x 120 MiB > high
    serve(engine, 8)
    assert guard.state is GuardState.SHEDDING
    tick(engine)  # the monitor's second that saw the big batch
    for _ in range(3):
        serve(engine, 1)
    assert guard.state is GuardState.OK
    tick(engine)
    assert guard.state is GuardState.OK
    assert guard.max_batch_now(engine.runtime.probe.in_use()) == 8


def test_guard_returns_to_ok_after_an_oom(serving):
    """A real out-of-memory (the device is full) is split and answered; afterwards, single
    images put the guard back at ok."""
    engine, cuda, forward = serving
    guard = engine.runtime.guard
    forward.per_image = 155 * MiB  # 6 fit in what another program leaves us (930 > high)
    cuda.others = 4 * GiB - 200 * MiB - WEIGHTS - 950 * MiB
    outcomes = serve(engine, 8)
    assert all(isinstance(o, Prediction) for o in outcomes)
    assert guard.counters.oom_events >= 1 and guard.counters.oom_failures == 0
    cuda.others = 0
    tick(engine)
    for _ in range(3):
        serve(engine, 1)
    tick(engine)
    assert guard.state is GuardState.OK


def test_batch_peak_is_the_last_forward_pass_and_the_report_keeps_the_running_maximum(serving):
    engine, _cuda, _forward = serving
    probe = engine.runtime.probe
    serve(engine, 8)
    serve(engine, 1)
    assert probe.batch_peak() == PER_IMAGE
    reading = probe.read()
    assert reading.peak_allocated == WEIGHTS + 8 * PER_IMAGE
    assert reading.peak_reserved == WEIGHTS + 8 * PER_IMAGE
    report = engine.batcher.call(engine.memory_report).result(10)
    assert report.peak_allocated_bytes == WEIGHTS + 8 * PER_IMAGE
    before, after = engine.batcher.call(engine.reset_peak).result(10)
    assert (before, after) == (WEIGHTS + 8 * PER_IMAGE, WEIGHTS)
    serve(engine, 2)
    assert probe.read().peak_allocated == WEIGHTS + 2 * PER_IMAGE


def test_measure_peak_does_not_lose_the_running_maximum(monkeypatch):
    cuda, _ = install_gpu(monkeypatch, total=4 * GiB)
    cuda.alloc(WEIGHTS)
    probe = CudaProbe(DEVICE, WEIGHTS)
    with probe.forward_scope():
        cuda.forward(500 * MiB)
    assert probe.measure_peak(lambda: cuda.forward(10 * MiB)) == 10 * MiB
    assert probe.read().peak_allocated == WEIGHTS + 500 * MiB


# -- NVML: the fallbacks to CUDA's own figures ----------------------------------------------


def probe_on(monkeypatch, **cuda_kwargs):
    """A CUDA probe on the stand-in GPU (weights allocated), and the two stand-ins."""
    cuda, nvml = install_gpu(monkeypatch, **cuda_kwargs)
    cuda.alloc(WEIGHTS)
    return cuda, nvml, lambda: CudaProbe(DEVICE, WEIGHTS)


def test_nvml_is_the_source_when_it_agrees_with_cuda(monkeypatch, caplog):
    cuda, nvml, make = probe_on(monkeypatch, total=8 * GiB, others=GiB)
    nvml.total = int(8 * GiB * 1.015)  # within 2 %
    with caplog.at_level(logging.INFO, "vramguard.memory"):
        probe = make()
        reading = probe.read()
        probe.read()
    assert reading.source == "nvml" and reading.total == nvml.total
    assert reading.process == cuda.context + cuda.reserved and reading.others == GiB
    sources = [r.getMessage() for r in caplog.records if "NVML" in r.getMessage()]
    assert len(sources) == 1 and f"PID {__import__('os').getpid()}" in sources[0]


def test_an_nvml_error_falls_back_to_cuda_and_says_so_once(monkeypatch, caplog):
    cuda, nvml, make = probe_on(monkeypatch, total=8 * GiB, others=GiB)
    probe = make()
    assert probe.read().source == "nvml"
    nvml.fail("nvmlDeviceGetMemoryInfo", code=15)  # "GPU is lost", from now on
    with caplog.at_level(logging.INFO, "vramguard.memory"):
        readings = [probe.read() for _ in range(3)]
    free, total = cuda.mem_get_info()
    assert all(r.source == "cuda" and (r.total, r.free) == (total, free) for r in readings)
    assert readings[0].used == cuda.used and readings[0].process == cuda.reserved
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "GPU is lost" in warnings[0].getMessage()


def test_an_nvml_error_at_start_falls_back_to_cuda(monkeypatch):
    _cuda, nvml, make = probe_on(monkeypatch)
    nvml.fail("nvmlDeviceGetMemoryInfo")
    assert make().read().source == "cuda"


def test_mig_uses_cudas_figures_for_the_slice(monkeypatch, caplog):
    """Under MIG the bus id names the parent GPU: NVML would report all 80 GiB."""
    _cuda, nvml, make = probe_on(monkeypatch, total=10 * GiB)
    nvml.mig, nvml.total = True, 80 * GiB
    with caplog.at_level(logging.INFO, "vramguard.memory"):
        reading = make().read()
    assert reading.source == "cuda" and reading.total == 10 * GiB
    assert "MIG" in caplog.text


def test_totals_that_disagree_by_more_than_2_percent_use_cuda(monkeypatch, caplog):
    _cuda, nvml, make = probe_on(monkeypatch, total=8 * GiB)
    nvml.total = int(8 * GiB * 1.03)
    with caplog.at_level(logging.INFO, "vramguard.memory"):
        reading = make().read()
    assert reading.source == "cuda" and reading.total == 8 * GiB
    assert "disagree" in caplog.text


def test_a_host_pid_is_not_taken_for_this_process(monkeypatch, caplog):
    """In a container NVML lists the host's PID: this process's use then comes from torch,
    and the log says the PID did not match."""
    cuda, nvml, make = probe_on(monkeypatch, total=8 * GiB)
    nvml.pid = 4242
    with caplog.at_level(logging.INFO, "vramguard.memory"):
        probe = make()
        reading = probe.read()
    assert reading.source == "nvml" and probe.process_used() is None
    assert reading.process == cuda.reserved
    assert "does not list this process" in caplog.text


def test_doctor_reports_driver_model_and_mig_mode(monkeypatch):
    from app.engine.system_checks import Checks, nvidia_driver

    def lines(cuda_available: bool) -> str:
        checks = Checks()
        nvidia_driver(cuda_available, checks)
        return checks.text()

    _cuda, nvml = install_gpu(monkeypatch)
    nvml.driver_model = nvml.module.NVML_DRIVER_WDM
    nvml.mig = True
    out = lines(cuda_available=True)
    assert "driver model" in out and "TCC" in out
    assert "MIG mode" in out and "on" in out.split("MIG mode")[1].splitlines()[0]
    nvml.driver_model, nvml.mig = None, False  # Linux: NOT_SUPPORTED
    out = lines(cuda_available=True)
    assert "n/a" in out.split("driver model")[1].splitlines()[0]
    assert "off" in out.split("MIG mode")[1].splitlines()[0]
    nvml.fail("nvmlInit")
    out = lines(cuda_available=False)
    assert "n/a" in out.split("driver model")[1].splitlines()[0]


def test_a_driver_older_than_nvidia_ml_py_still_tells_its_driver_model(monkeypatch):
    """The library's nvmlDeviceGetDriverModel calls the _v2 symbol, which such a driver
    lacks: the v1 one answers (with the v1 fallback removed, "n/a")."""
    from app.memory.nvml import Nvml

    _cuda, nvml = install_gpu(monkeypatch)
    nvml.driver_model = nvml.module.NVML_DRIVER_WDDM
    nvml.fail("nvmlDeviceGetDriverModel_v2", nvml.module.NVML_ERROR_FUNCTION_NOT_FOUND)
    opened = Nvml.open()
    assert opened is not None and opened.driver_model() == "WDDM"
    assert nvml.calls["nvmlDeviceGetDriverModel_v1"] == 1


def test_doctor_asks_nvml_about_the_device_it_will_use_by_its_bus_id(monkeypatch):
    """CUDA_VISIBLE_DEVICES renumbers devices for CUDA, not for NVML: index 0 could be
    another GPU."""
    import torch

    from app.engine.system_checks import Checks, nvidia_driver

    _cuda, nvml = install_gpu(monkeypatch)
    nvidia_driver(True, Checks(), torch.device("cuda", 0))
    assert nvml.calls["nvmlDeviceGetHandleByPciBusId"] == 1
    assert nvml.calls["nvmlDeviceGetHandleByIndex"] == 0


# -- the persistent cuBLAS workspace --------------------------------------------------------


def test_the_cublas_workspace_is_a_baseline_not_activations(monkeypatch):
    """cuBLAS keeps its workspace allocated (through PyTorch's allocator) after the first
    matrix product: it is neither weights nor live activations, and it is not overhead."""
    cuda, _, make = probe_on(monkeypatch, total=8 * GiB)
    probe = make()
    cuda.alloc(32 * MiB)  # warmup's first matrix product creates the workspace
    cuda.forward(300 * MiB)
    probe.empty_cache()
    probe.set_baseline()
    assert probe.workspaces == 32 * MiB
    assert probe.in_use() == 0
    with probe.forward_scope():
        cuda.forward(100 * MiB)
    assert probe.batch_peak() == 100 * MiB
    reading = probe.read()
    assert reading.overhead == cuda.context  # the workspace is inside PyTorch's reserved
    budget = Budget(total=8 * GiB, fraction=0.5, weights=WEIGHTS, overhead=reading.overhead,
                    workspaces=probe.workspaces)
    assert budget.bytes == 4 * GiB - WEIGHTS - 32 * MiB - cuda.context
    assert any("workspace" in line for line in budget.lines())


def test_the_cpu_has_no_workspace_baseline():
    probe = CpuProbe(weights=123)
    probe.set_baseline()
    assert probe.workspaces == 0 and probe.in_use() == 0


def test_record_history_keeps_python_stacks_only_and_a_small_cap(serving, monkeypatch):
    """stacks="all" is refused on Windows and blocks the device thread while it
    symbolises C++ frames; 200,000 entries make a snapshot the visualiser chokes on."""
    from app.api import memory as memory_api

    engine, cuda, _ = serving
    monkeypatch.setattr(memory_api, "_engine", lambda request: engine)
    answer = asyncio.run(memory_api.record_history(None, seconds=0.01))
    assert answer["snapshot_file"].endswith(".pickle")
    start, stop = cuda.history
    assert start["stacks"] == "python" and start["max_entries"] <= 50_000
    assert stop["enabled"] is None


def test_the_history_route_leaves_the_leak_tracers_recording_on(serving, monkeypatch):
    """The leak tracer records live blocks' stacks from the first rise of memory left in
    use; a snapshot asked for meanwhile must not switch that off when it is done (with
    the shared switch reverted, the route's stop was enabled=None)."""
    from app.api import memory as memory_api
    from app.memory.history import TRACER

    engine, cuda, _ = serving
    monkeypatch.setattr(memory_api, "_engine", lambda request: engine)
    engine.upkeep.history.want(TRACER, True)
    asyncio.run(memory_api.record_history(None, seconds=0.01))
    tracer, route, back = cuda.history
    assert tracer["enabled"] == "state" and route["max_entries"] <= 50_000
    assert back == tracer  # the tracer's mode again, not off
    engine.upkeep.history.want(TRACER, False)
    assert cuda.history[-1]["enabled"] is None


def test_warmup_takes_the_workspace_baseline_into_the_budget(monkeypatch):
    """The engine baselines the probe after warmup, and the budget deducts what stays."""
    from tiny_model import tiny_model

    from app.config import load_settings

    def settle(probe: CpuProbe) -> None:
        probe.workspaces = 8 * MiB  # as cuBLAS would on a GPU

    monkeypatch.setattr(CpuProbe, "set_baseline", settle)
    engine = InferenceEngine(load_settings(device="cpu", max_batch_size=2, cache=False))
    runtime = engine.warm_up(tiny_model())
    assert runtime.guard.budget.workspaces == 8 * MiB
    assert any("workspaces" in line for line in runtime.guard.budget.lines())


def test_wddm_lists_this_process_without_a_figure(monkeypatch, caplog):
    cuda, nvml, make = probe_on(monkeypatch, total=8 * GiB)
    nvml.process_used = None  # the Windows WDDM driver model
    with caplog.at_level(logging.INFO, "vramguard.memory"):
        reading = make().read()
    assert reading.source == "nvml" and reading.process == cuda.reserved
    assert "WDDM" in caplog.text
