"""What this computer has for vramguard, as lines a person can read: the versions, the
native libraries torch needs, the NVIDIA driver, the device the settings choose.

`vramguard doctor` prints them before it loads a model; the support report of a running
server (`app/api/support.py`) carries the same lines, without loading a second model.
Each line is marked ok or not: a line that is not ok names what to do.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from app import __version__
from app.config import Settings

if TYPE_CHECKING:
    import torch
from app.host.native_libs import check_cuda_libraries, check_driver, check_vc_runtime, library_dirs

DRIVER_MODEL_NOTES = {
    "WDDM": "WDDM (Windows display mode: the driver does not report each program's use)",
    "TCC": "TCC (Windows compute-only mode)",
    "MCDM": "MCDM (Windows compute mode)",
}


@dataclass(frozen=True)
class Check:
    name: str
    value: str
    ok: bool = True

    def line(self) -> str:
        return f"{'ok ' if self.ok else '!! '}{self.name:<22} {self.value}"


@dataclass
class Checks:
    """The lines so far; ``echo`` sees each as it is added (doctor prints it at once:
    loading the native libraries can take seconds)."""

    echo: Callable[[Check], None] = lambda check: None
    lines: list[Check] = field(default_factory=list)
    stopped: bool = False  # a check failed that the ones after it need

    def add(self, name: str, value: object, ok: bool = True) -> None:
        check = Check(name, str(value), ok)
        self.lines.append(check)
        self.echo(check)

    @property
    def problems(self) -> int:
        return sum(not check.ok for check in self.lines)

    def text(self) -> str:
        return "".join(check.line() + "\n" for check in self.lines)


def native_libraries(settings: Settings, checks: Checks) -> None:
    """Load what torch needs from the bundle and from the computer."""
    for check in check_vc_runtime():
        checks.add(check.name, "found" if check.ok else "MISSING: install the Microsoft Visual "
                   "C++ Redistributable (x64) from "
                   "https://aka.ms/vs/17/release/vc_redist.x64.exe", ok=check.ok)
    folders = library_dirs()
    libraries = check_cuda_libraries(folders)
    driver = check_driver()
    where = ", ".join(str(folder) for folder in folders)
    checks.add("CUDA libraries", f"{len(libraries)} bundled, {sum(c.ok for c in libraries)} "
               f"load (in {where})" if libraries else "none bundled (a CPU-only build)")
    for library in libraries:
        if library.ok:
            checks.add(f"  {library.name}", "loads")
        elif not driver.ok and library.needs_driver():
            checks.add(f"  {library.name}", "needs the NVIDIA driver (below)")
        else:
            checks.add(f"  {library.name}", f"does not load: {library.error}", ok=False)
    wants_gpu = settings.device.startswith("cuda")
    checks.add("NVIDIA driver library", "found" if driver.ok else "not found: vramguard uses "
               "the CPU. To use an NVIDIA GPU, install its driver from "
               "https://www.nvidia.com/drivers", ok=driver.ok or not wants_gpu)


def nvidia_driver(cuda_available: bool, checks: Checks, device: torch.device | None = None
                  ) -> None:
    """What NVML says about the driver: version, driver model (Windows only) and MIG mode,
    which decide where vramguard's memory figures can come from; of CUDA ``device`` (found
    by its PCI bus id: CUDA_VISIBLE_DEVICES renumbers devices for CUDA, not for NVML)."""
    import torch

    from app.engine.device import SYSMEM_FALLBACK_ADVICE, driver_verdict
    from app.memory.nvml import Nvml
    from app.memory.probes import pci_bus_id

    if device is not None and device.type == "cuda":
        nvml = Nvml.open(pci_bus_id(device), device.index or 0)
    else:
        nvml = Nvml.open()
    version, version_ok = driver_verdict(nvml.driver_version(), torch.version.cuda) \
        if nvml else ("not found (normal without an NVIDIA GPU)", not cuda_available)
    checks.add("NVIDIA driver (NVML)", version, ok=version_ok)
    model = nvml.driver_model() if nvml else "n/a"
    checks.add("driver model", DRIVER_MODEL_NOTES.get(model, model))
    if model == "WDDM":
        checks.add("  advice", SYSMEM_FALLBACK_ADVICE)
    mig = nvml.mig_enabled() if nvml else None
    checks.add("MIG mode", "n/a" if mig is None else "on (memory figures come from CUDA, "
               "for this GPU instance)" if mig else "off")


def system_checks(settings: Settings, config_file: Path, checks: Checks) -> Checks:
    """Everything up to the device the settings choose; ``checks.stopped`` when torch
    cannot be loaded or the device cannot be used (nothing after it could run)."""
    checks.add("vramguard", __version__)
    checks.add("python", f"{platform.python_version()} ({sys.executable})")
    checks.add("platform", platform.platform())
    native_libraries(settings, checks)
    try:
        import torch
        import torchvision
    except (ImportError, OSError) as exc:
        checks.add("torch", f"cannot be loaded: {exc}", ok=False)
        checks.stopped = True
        return checks

    from app.engine.device import DeviceError, resolve_device, unsupported_gpu

    checks.add("torch", f"{torch.__version__} (built for CUDA {torch.version.cuda or 'none'})")
    checks.add("torchvision", torchvision.__version__)
    checks.add("config file", f"{config_file}" + ("" if config_file.is_file() else
                                                   " (none there: defaults are used)"))
    checks.add("cache folder", f"{settings.cache_dir} ({'on' if settings.cache else 'off'})")
    checks.add("log folder", settings.log_dir)
    checks.add("admin token file", settings.token_file)
    cuda = torch.cuda.is_available()
    checks.add("NVIDIA GPU", "available" if cuda else "none found (vramguard will use the CPU)")
    for index in range(torch.cuda.device_count() if cuda else 0):
        props = torch.cuda.get_device_properties(index)
        checks.add(f"  cuda:{index}", f"{props.name}, {props.total_memory / 1024**3:.1f} GiB")
    try:
        device = resolve_device(settings.device)
    except DeviceError as exc:
        nvidia_driver(cuda, checks)
        checks.add("device", exc, ok=False)
        checks.stopped = True
        return checks
    nvidia_driver(cuda, checks, device)
    try:
        checks.add("device", f"{device} (setting: {settings.device})")
        if cuda and device.type == "cpu" and (too_old := unsupported_gpu(0)):
            checks.add("  why not the GPU", f"{too_old}; vramguard runs on the CPU (slower)",
                       ok=False)
    except DeviceError as exc:
        checks.add("device", exc, ok=False)
        checks.stopped = True
    return checks
