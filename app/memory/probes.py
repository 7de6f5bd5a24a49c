"""Memory probes: the same readings from a GPU (torch.cuda + NVML) or the CPU.

``others`` is what the device uses that torch does not hold (CUDA context,
library workspaces, other programs); its growth since start shrinks the
budget. On the CPU the device is system memory and the live-tensor tracker
plays the allocator.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from app.memory.nvml import Nvml
from app.memory.tracker import LiveTensorTracker


@dataclass(frozen=True)
class MemoryReading:
    device: str
    total: int
    used: int
    free: int
    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int
    source: str
    process: int

    @property
    def overhead(self) -> int:
        """What the device uses that torch does not hold (context, libraries, others)."""
        return max(0, self.used - self.reserved)

    @property
    def others(self) -> int:
        """What other programs use: the figure whose growth shrinks the budget."""
        return max(0, self.used - self.process)


class CudaProbe:
    """torch.cuda's allocator figures, NVML's whole-device view where it exists."""

    def __init__(self, device: torch.device, weights: int) -> None:
        self.device = device
        self.weights = weights
        # The PCI address is on every CUDA build's device properties, but not in torch's stubs.
        props: Any = torch.cuda.get_device_properties(device)
        bus = (f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:"
               f"{props.pci_device_id:02X}.0")
        self.nvml = Nvml.open(bus, device.index or 0)

    def read(self) -> MemoryReading:
        if self.nvml is not None:
            total, used, free = self.nvml.memory()
            source = "nvml"
        else:
            free, total = torch.cuda.mem_get_info(self.device)
            used, source = total - free, "cuda"
        return MemoryReading(
            device=str(self.device), total=total, used=used, free=free,
            allocated=torch.cuda.memory_allocated(self.device),
            reserved=torch.cuda.memory_reserved(self.device),
            peak_allocated=torch.cuda.max_memory_allocated(self.device),
            peak_reserved=torch.cuda.max_memory_reserved(self.device),
            source=source, process=self.process_used() or torch.cuda.memory_reserved(self.device))

    def process_used(self) -> int | None:
        """This process's use of the whole GPU, where the driver reports it (not WDDM)."""
        return self.nvml.process_used(os.getpid()) if self.nvml else None

    def in_use(self) -> int:
        """Live activation bytes right now (beyond the weights)."""
        return max(0, torch.cuda.memory_allocated(self.device) - self.weights)

    def held(self) -> int:
        """What we hold beyond the weights, cached blocks included: the watermark figure."""
        return max(0, torch.cuda.memory_reserved(self.device) - self.weights)

    @contextlib.contextmanager
    def forward_scope(self) -> Iterator[None]:
        yield

    def batch_peak(self) -> int | None:
        return max(0, torch.cuda.max_memory_allocated(self.device) - self.weights)

    def measure_peak(self, run: Callable[[], object]) -> int:
        """Peak bytes allocated above the current level while ``run`` runs."""
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        run()
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - base)

    def empty_cache(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def set_backstop(self, fraction: float) -> None:
        """The hard limit the caching allocator itself enforces."""
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)


class CpuProbe:
    """System memory as the device; tensor bytes from the tracker when one is in use.

    With ``cap`` set, every forward pass runs under a capped tracker (the
    honest stand-in for a GPU that is full). Without it, tracking would slow
    every pass, so live bytes between passes are taken as zero (everything a
    pass allocates is freed when it returns) and peaks are estimated.
    """

    def __init__(self, weights: int, cap: int | None = None) -> None:
        self.device = torch.device("cpu")
        self.weights = weights
        self.cap = cap
        self.tracker = LiveTensorTracker(cap=cap, base=weights) if cap is not None else None
        self._peak_reserved = weights

    def read(self) -> MemoryReading:
        memory = psutil.virtual_memory()
        allocated = self.weights + (self.tracker.live if self.tracker else 0)
        peak = self.weights + (self.tracker.peak if self.tracker else 0)
        self._peak_reserved = max(self._peak_reserved, peak)
        return MemoryReading(
            device="cpu", total=memory.total, used=memory.total - memory.available,
            free=memory.available, allocated=allocated, reserved=allocated,
            peak_allocated=peak, peak_reserved=self._peak_reserved,
            source="cpu-tracker" if self.tracker else "cpu", process=self.process_used())

    def process_used(self) -> int:
        """Resident memory of this process."""
        return int(psutil.Process().memory_info().rss)

    def in_use(self) -> int:
        return self.tracker.live if self.tracker else 0

    def held(self) -> int:
        return self.in_use()

    @contextlib.contextmanager
    def forward_scope(self) -> Iterator[None]:
        if self.tracker is None:
            yield
            return
        self.tracker.reset_peak()
        with self.tracker:
            yield

    def batch_peak(self) -> int | None:
        return self.tracker.peak if self.tracker else None

    def measure_peak(self, run: Callable[[], object]) -> int:
        tracker = LiveTensorTracker()
        with tracker:
            run()
        return tracker.peak

    def empty_cache(self) -> None:
        """Nothing is cached on the CPU: torch returns freed tensors to the system."""

    def reset_peak(self) -> None:
        if self.tracker:
            self.tracker.reset_peak()
        self._peak_reserved = self.weights

    def set_backstop(self, fraction: float) -> None:
        """The CPU's backstop is the tracker's cap, when one is set."""


Probe = CudaProbe | CpuProbe


def make_probe(device: torch.device, weights: int, cpu_cap: int | None) -> Probe:
    if device.type == "cuda":
        return CudaProbe(device, weights)
    return CpuProbe(weights, cpu_cap)
