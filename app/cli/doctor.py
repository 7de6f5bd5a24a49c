"""`vramguard doctor`: what this computer has, and whether the model can run on it."""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

from app import __version__
from app.config import Settings
from app.host.native_libs import check_cuda_libraries, check_driver, check_vc_runtime, library_dirs


def _line(name: str, value: object, ok: bool = True) -> None:
    mark = "ok " if ok else "!! "
    print(f"{mark}{name:<22} {value}")


def _native_libraries(settings: Settings) -> int:
    """Load what torch needs from the bundle and from the computer; count the failures."""
    problems = 0
    for check in check_vc_runtime():
        _line(check.name, "found" if check.ok else "MISSING: install the Microsoft Visual "
              "C++ Redistributable (x64) from https://aka.ms/vs/17/release/vc_redist.x64.exe",
              ok=check.ok)
        problems += not check.ok
    folders = library_dirs()
    checks = check_cuda_libraries(folders)
    driver = check_driver()
    where = ", ".join(str(folder) for folder in folders)
    _line("CUDA libraries", f"{len(checks)} bundled, {sum(c.ok for c in checks)} load "
          f"(in {where})" if checks else "none bundled (a CPU-only build)")
    for check in checks:
        if check.ok:
            _line(f"  {check.name}", "loads")
        elif not driver.ok and check.needs_driver():
            _line(f"  {check.name}", "needs the NVIDIA driver (below)")
        else:
            _line(f"  {check.name}", f"does not load: {check.error}", ok=False)
            problems += 1
    wants_gpu = settings.device.startswith("cuda")
    _line("NVIDIA driver library", "found" if driver.ok else "not found: vramguard uses the CPU. "
          "To use an NVIDIA GPU, install its driver from https://www.nvidia.com/drivers",
          ok=driver.ok or not wants_gpu)
    return problems + (not driver.ok and wants_gpu)


DRIVER_MODEL_NOTES = {
    "WDDM": "WDDM (Windows display mode: the driver does not report each program's use)",
    "TCC": "TCC (Windows compute-only mode)",
    "MCDM": "MCDM (Windows compute mode)",
}


def _nvidia_driver(cuda_available: bool) -> None:
    """What NVML says about the driver: version, driver model (Windows only) and MIG mode,
    which decide where vramguard's memory figures can come from."""
    import torch

    from app.engine.device import SYSMEM_FALLBACK_ADVICE, driver_verdict
    from app.memory.nvml import Nvml

    nvml = Nvml.open()
    version, version_ok = driver_verdict(nvml.driver_version(), torch.version.cuda) \
        if nvml else ("not found (normal without an NVIDIA GPU)", not cuda_available)
    _line("NVIDIA driver (NVML)", version, ok=version_ok)
    model = nvml.driver_model() if nvml else "n/a"
    _line("driver model", DRIVER_MODEL_NOTES.get(model, model))
    if model == "WDDM":
        _line("  advice", SYSMEM_FALLBACK_ADVICE)
    mig = nvml.mig_enabled() if nvml else None
    _line("MIG mode", "n/a" if mig is None else "on (memory figures come from CUDA, for this "
          "GPU instance)" if mig else "off")


def run_doctor(settings: Settings, config_file: Path) -> int:
    """Print one line per check; exit status 1 when any check found a problem."""
    _line("vramguard", __version__)
    _line("python", f"{platform.python_version()} ({sys.executable})")
    _line("platform", platform.platform())
    problems = _native_libraries(settings)
    try:
        import torch
        import torchvision
    except (ImportError, OSError) as exc:
        _line("torch", f"cannot be loaded: {exc}", ok=False)
        print(f"{problems + 1} problem(s) found: the libraries marked !! above are the "
              "likely cause")
        return 1

    from app.engine.device import DeviceError, resolve_device, unsupported_gpu
    from app.engine.engine import InferenceEngine
    from app.engine.residency import needed
    from app.memory.diagnostics import IDLE_PERIOD_S, cache_verdict, leak_check_verdict
    from app.memory.probes import CpuProbe
    from app.models import ModelLoadError, catalogue
    from app.units import human_bytes

    _line("torch", f"{torch.__version__} (built for CUDA {torch.version.cuda or 'none'})")
    _line("torchvision", torchvision.__version__)
    _line("config file", f"{config_file}" + ("" if config_file.is_file() else
                                              " (none there: defaults are used)"))
    _line("cache folder", f"{settings.cache_dir} ({'on' if settings.cache else 'off'})")
    _line("log folder", settings.log_dir)
    _line("admin token file", settings.token_file)
    cuda = torch.cuda.is_available()
    _line("NVIDIA GPU", "available" if cuda else "none found (vramguard will use the CPU)")
    for index in range(torch.cuda.device_count() if cuda else 0):
        props = torch.cuda.get_device_properties(index)
        _line(f"  cuda:{index}", f"{props.name}, {props.total_memory / 1024**3:.1f} GiB")
    _nvidia_driver(cuda)
    try:
        device = resolve_device(settings.device)
        _line("device", f"{device} (setting: {settings.device})")
        if cuda and device.type == "cpu" and (too_old := unsupported_gpu(0)):
            _line("  why not the GPU", f"{too_old}; vramguard runs on the CPU (slower)",
                  ok=False)
    except DeviceError as exc:
        _line("device", exc, ok=False)
        return 1
    try:
        started = time.perf_counter()
        engine = InferenceEngine(settings)
        runtime = engine.warm_up(engine.load())
        elapsed = time.perf_counter() - started
        _line("model", f"{runtime.model.name} loaded and warmed up in {elapsed:.2f} s "
              f"({runtime.model.weights_file})")
    except (ModelLoadError, RuntimeError, OSError) as exc:
        _line("model", exc, ok=False)
        print(f"{problems + 1} problem(s) found")
        return 1
    fit = runtime.memory.fit
    _line("batch size", f"{engine.batcher.max_batch} "
          f"({runtime.warmup.throughput_at(engine.batcher.max_batch):.1f} images/s at warmup)")
    _line("memory per batch", f"{human_bytes(fit.fixed_bytes)} + "
          f"{human_bytes(fit.bytes_per_sample)} per image (measured at warmup)")
    reading, probe = runtime.probe.read(), runtime.probe
    _line("allocator cache", cache_verdict(reading.device, reading.allocated, reading.reserved))
    _line("leak check", leak_check_verdict(not isinstance(probe, CpuProbe) or probe.tracker
                                           is not None, settings.idle_release_s or IDLE_PERIOD_S))
    print("   budget:")
    for text in runtime.guard.budget.lines():
        print(f"     {text}")
    room = runtime.guard.budget.room
    _line("room for models", f"{human_bytes(room)} for the weights of every loaded model "
          f"and the batch in flight; {runtime.model.name} takes "
          f"{human_bytes(needed([runtime.footprint]))}, leaving "
          f"{human_bytes(max(0, room - needed([runtime.footprint])))} for other models "
          "(idle ones are unloaded when a request needs the room)")
    entries = catalogue()
    _line("models", ", ".join(e.name for e in entries if e.installed))
    for entry in entries:
        if not entry.installed:
            _line(f"  {entry.name}", f"cannot load: {entry.note}", ok=False)
            problems += 1
    if runtime.guard.budget_bytes < fit.peak(1):
        _line("budget", "too small for even one image: close programs that use the GPU, or "
              "raise memory_fraction", ok=False)
        problems += 1
    print("all checks passed" if not problems else f"{problems} problem(s) found")
    return 1 if problems else 0
