"""NVML (nvidia-ml-py) readings. Absent or failing NVML is a normal state, not an error.

NVML sees the whole GPU: what every process uses, which torch cannot. Every
reading here answers None when NVML fails, so the caller can fall back to
CUDA's own figures. Under Windows WDDM drivers NVML does not report per-process
use, and in a container it lists processes by their host PIDs, so nothing
depends on finding this process.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("vramguard.memory")

# nvmlDeviceGetDriverModel's values; TCC is called WDM in NVML.
DRIVER_MODELS = {0: "WDDM", 1: "TCC", 2: "MCDM"}
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_DEVICE_MIG_ENABLE = 1


class Nvml:
    """One GPU's NVML handle."""

    def __init__(self, module: Any, handle: Any) -> None:
        self._nvml = module
        self._handle = handle

    @classmethod
    def open(cls, pci_bus_id: str | None = None, index: int = 0) -> Nvml | None:
        """The device by PCI bus id (robust to CUDA_VISIBLE_DEVICES), else by index."""
        try:
            import pynvml

            pynvml.nvmlInit()
            if pci_bus_id:
                handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id.encode())
            else:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            return cls(pynvml, handle)
        except Exception as exc:  # no driver, no library, no such device: all normal
            log.info("NVML not available: %s", exc)
            return None

    def memory(self) -> tuple[int, int, int]:
        """(total, used, free) bytes of the whole device; raises what NVML raises."""
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        return int(info.total), int(info.used), int(info.free)

    def driver_version(self) -> str:
        try:
            version = self._nvml.nvmlSystemGetDriverVersion()
        except Exception as exc:
            return f"unknown ({exc})"
        return version.decode() if isinstance(version, bytes) else str(version)

    def driver_model(self) -> str:
        """WDDM, TCC or MCDM on Windows; "n/a" where NVML does not say (Linux).

        nvidia-ml-py's ``nvmlDeviceGetDriverModel`` calls the ``_v2`` symbol, which a
        driver older than the library lacks ("Function Not Found"): the v1 one answers
        there."""
        nvml = self._nvml
        for name in ("nvmlDeviceGetDriverModel_v2", "nvmlDeviceGetDriverModel_v1"):
            call = getattr(nvml, name, None)
            if call is None:
                continue
            try:
                current = call(self._handle)[0]
            except Exception as exc:
                if getattr(exc, "value", None) == NVML_ERROR_FUNCTION_NOT_FOUND:
                    continue
                return "n/a"
            return DRIVER_MODELS.get(int(current), f"unknown ({current})")
        return "n/a"

    def mig_enabled(self) -> bool | None:
        """Whether the GPU is split into MIG instances; None when NVML cannot tell.

        GPUs without MIG answer "not supported", which means off."""
        try:
            current = self._nvml.nvmlDeviceGetMigMode(self._handle)[0]
        except Exception as exc:
            return False if getattr(exc, "value", None) == NVML_ERROR_NOT_SUPPORTED else None
        return int(current) == NVML_DEVICE_MIG_ENABLE

    def process_used(self, pid: int) -> int | None:
        """Bytes ``pid`` uses on this GPU, when NVML lists it with a figure (not WDDM)."""
        try:
            for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    return int(proc.usedGpuMemory)
        except Exception:
            return None
        return None

    def processes(self) -> dict[int, int | None]:
        """Every process NVML lists on this GPU, compute (CUDA) and graphics (games, the
        browser, the desktop), with its bytes where the driver gives them (None under
        Windows' WDDM, and for a process in both lists without a figure); {} on failure."""
        found: dict[int, int | None] = {}
        for call in ("nvmlDeviceGetComputeRunningProcesses",
                     "nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                listed = getattr(self._nvml, call)(self._handle)
            except Exception:
                continue
            for proc in listed:
                used = proc.usedGpuMemory
                known = found.get(proc.pid)
                found[proc.pid] = (known if used is None else
                                   int(used) if known is None else max(known, int(used)))
        return found

    def utilization(self) -> float | None:
        """Share of NVML's last sample period (1/6 s to 1 s) in which the GPU ran a kernel,
        any program's; None when NVML cannot tell (a MIG instance, an error)."""
        try:
            return int(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu) / 100
        except Exception:
            return None

    def lists_process(self, pid: int) -> bool:
        """Whether NVML lists ``pid`` among the GPU's processes (false in a container)."""
        try:
            processes = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception:
            return False
        return any(proc.pid == pid for proc in processes)
