"""NVML (nvidia-ml-py) readings. Absent or failing NVML is a normal state, not an error.

NVML sees the whole GPU: what every process uses, which torch cannot. Under
Windows WDDM drivers it does not report per-process use, so nothing depends
on that.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("vramguard.memory")


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
        """(total, used, free) bytes of the whole device."""
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        return int(info.total), int(info.used), int(info.free)

    def driver_version(self) -> str:
        version = self._nvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)

    def process_used(self, pid: int) -> int | None:
        """Bytes ``pid`` uses on this GPU, when the driver says (not under WDDM)."""
        try:
            for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    return int(proc.usedGpuMemory)
        except Exception:
            return None
        return None
