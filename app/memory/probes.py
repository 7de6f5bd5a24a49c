"""Memory probes: the same readings from a GPU (torch.cuda + NVML) or the CPU.

``others`` is device used minus this process's use: other programs, plus our
CUDA context where NVML gives no figure for this process (then PyTorch's
reserved stands in for it); its growth since start shrinks the budget. On the
CPU the device is system memory and the live-tensor tracker plays the
allocator.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from app.memory.nvml import Nvml
from app.memory.tracker import LiveTensorTracker
from app.units import human_bytes

log = logging.getLogger("vramguard.memory")
# NVML's and CUDA's totals of one device agree to the byte on the GPUs we know; a larger
# gap means NVML is describing something else (a parent GPU, another device).
TOTALS_TOLERANCE = 0.02


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
    inactive_split: int = 0  # free bytes inside segments that also hold live blocks

    @property
    def overhead(self) -> int:
        """What the device uses that torch does not hold (context, libraries, others)."""
        return max(0, self.used - self.reserved)

    @property
    def others(self) -> int:
        """What other programs use: the figure whose growth shrinks the budget."""
        return max(0, self.used - self.process)


@dataclass(frozen=True)
class Stats:
    """One reading of the caching allocator (``memory_stats_as_nested_dict``)."""

    nested: dict[str, Any]

    def figure(self, name: str, which: str = "current") -> int:
        return int(self.nested.get(name, {}).get("all", {}).get(which, 0))

    @property
    def allocated(self) -> int:
        return self.figure("allocated_bytes")

    @property
    def reserved(self) -> int:
        return self.figure("reserved_bytes")

    @property
    def peak_allocated(self) -> int:
        return self.figure("allocated_bytes", "peak")

    @property
    def peak_reserved(self) -> int:
        return self.figure("reserved_bytes", "peak")

    @property
    def ooms(self) -> int:
        return int(self.nested.get("num_ooms", 0))


def pci_bus_id(device: torch.device) -> str:
    """CUDA device ``device``'s PCI address as NVML spells it (robust to
    CUDA_VISIBLE_DEVICES, which renumbers devices for CUDA but not for NVML)."""
    # On every CUDA build's device properties, but not in torch's stubs.
    props: Any = torch.cuda.get_device_properties(device)
    return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"


class CudaProbe:
    """torch.cuda's allocator figures, NVML's whole-device view where it can be trusted.

    NVML is the source of device-wide figures only when it describes this very
    device: not under MIG (the bus id then names the parent GPU), not when its
    total disagrees with CUDA's, and only until it fails; otherwise, and from
    then on, ``torch.cuda.mem_get_info``.
    """

    def __init__(self, device: torch.device, weights: int) -> None:
        self.device = device
        self.weights = weights
        props: Any = torch.cuda.get_device_properties(device)  # uuid: not in torch's stubs
        bus = pci_bus_id(device)
        self.nvml = Nvml.open(bus, device.index or 0)
        # What other vramguards on this GPU name it by: a MIG instance has a UUID of its own.
        self.gpu_id = str(getattr(props, "uuid", "") or bus)
        self.workspaces = 0
        self._pid_listed = False
        self._memory_nvml = self._choose_memory_source()
        # CUDA's own peak is reset for every forward pass (it is the batch's peak, which
        # the guard reads); /v1/memory's peaks are these running maxima, kept beside it.
        self._peak_allocated = 0
        self._peak_reserved = 0

    def _choose_memory_source(self) -> Nvml | None:
        """NVML when it describes this device, else None (CUDA); logged once, with why."""
        nvml = self.nvml
        reason = "NVML is not available"
        if nvml is not None and nvml.mig_enabled():
            reason = ("the GPU is split into MIG instances, and NVML would report the whole "
                      "GPU rather than the part this program runs on")
        elif nvml is not None:
            cuda_total = torch.cuda.mem_get_info(self.device)[1]
            try:
                nvml_total = nvml.memory()[0]
            except Exception as exc:
                reason = f"NVML failed: {exc}"
            else:
                if abs(nvml_total - cuda_total) <= TOTALS_TOLERANCE * cuda_total:
                    self._log_nvml_source(nvml)
                    return nvml
                reason = (f"NVML's device size ({human_bytes(nvml_total)}) and CUDA's "
                          f"({human_bytes(cuda_total)}) disagree by more than "
                          f"{TOTALS_TOLERANCE:.0%}")
        log.info("device memory figures come from CUDA, not NVML: %s", reason)
        return None

    def _log_nvml_source(self, nvml: Nvml) -> None:
        pid = os.getpid()
        self._pid_listed = nvml.lists_process(pid)
        if self._pid_listed and nvml.process_used(pid) is None:
            log.info("device memory figures come from NVML, which lists this process (PID %d) "
                     "without a figure (the Windows WDDM driver model): this process's use is "
                     "taken from PyTorch's figure instead", pid)
        elif self._pid_listed:
            log.info("device memory figures come from NVML, which lists this process "
                     "(PID %d)", pid)
        else:
            log.info("device memory figures come from NVML, which does not list this process "
                     "(PID %d; in a container it lists the host's process numbers): this "
                     "process's use is taken from PyTorch's figure instead", pid)

    def _device_memory(self) -> tuple[int, int, int, str]:
        """(total, used, free, source) of the whole device; CUDA's for good once NVML fails."""
        if self._memory_nvml is not None:
            try:
                return (*self._memory_nvml.memory(), "nvml")
            except Exception as exc:
                log.warning("NVML stopped answering (%s): device memory figures come from "
                            "CUDA from now on", exc)
                self._memory_nvml = None
        free, total = torch.cuda.mem_get_info(self.device)
        return total, total - free, free, "cuda"

    def _stats(self) -> Stats:
        """The caching allocator's figures, read once per phase of a batch. Each of
        ``torch.cuda.memory_allocated``, ``memory_reserved`` and the peaks builds, flattens
        and sorts all of them (0.3-0.5 ms, against 3-5 ms for a batch of one); the nested
        form is what they are built from."""
        return Stats(torch.cuda.memory_stats_as_nested_dict(self.device))

    def read(self) -> MemoryReading:
        total, used, free, source = self._device_memory()
        stats = self._stats()
        return MemoryReading(
            device=str(self.device), total=total, used=used, free=free,
            allocated=stats.allocated, reserved=stats.reserved,
            peak_allocated=max(self._peak_allocated, stats.peak_allocated),
            peak_reserved=max(self._peak_reserved, stats.peak_reserved),
            source=source, process=self.process_used() or stats.reserved,
            inactive_split=stats.figure("inactive_split_bytes"))

    def allocator_ooms(self) -> int:
        """How many allocations the caching allocator has failed (``num_ooms``): its
        rise during a call is what tells a swallowed OOM from another failure."""
        return self._stats().ooms

    def process_used(self) -> int | None:
        """This process's use of the whole GPU, where NVML is the source and lists it by
        its PID with a figure (not under WDDM, not in a container)."""
        if self._memory_nvml is None or not self._pid_listed:
            return None
        return self._memory_nvml.process_used(os.getpid())

    @property
    def baseline(self) -> int:
        """Bytes that stay allocated between batches: the weights and library workspaces."""
        return self.weights + self.workspaces

    def set_baseline(self) -> None:
        """After warmup: what is allocated beyond the weights now stays for good (cuBLAS
        keeps its workspace, allocated through PyTorch, from the first matrix product on),
        so it is not counted as a batch's activations."""
        torch.cuda.synchronize(self.device)
        self.workspaces = max(0, self._stats().allocated - self.weights)

    def in_use(self) -> int:
        """Live activation bytes right now (beyond the baseline)."""
        return max(0, self._stats().allocated - self.baseline)

    @contextlib.contextmanager
    def forward_scope(self) -> Iterator[None]:
        """Start the batch's peak afresh: without it one big batch (or an OOM) would count
        as every later batch's usage, and the guard would shed for ever."""
        self._restart_cuda_peak()
        yield

    def batch_peak(self) -> int | None:
        """The last forward pass's peak beyond the baseline."""
        return max(0, self._stats().peak_allocated - self.baseline)

    def _restart_cuda_peak(self) -> None:
        """Reset CUDA's peak counters, folding them into the running maxima first."""
        stats = self._stats()
        self._peak_allocated = max(self._peak_allocated, stats.peak_allocated)
        self._peak_reserved = max(self._peak_reserved, stats.peak_reserved)
        torch.cuda.reset_peak_memory_stats(self.device)

    def measure_peak(self, run: Callable[[], object]) -> int:
        """Peak bytes allocated above the current level while ``run`` runs."""
        torch.cuda.synchronize(self.device)
        base = self._stats().allocated
        self._restart_cuda_peak()
        run()
        torch.cuda.synchronize(self.device)
        return max(0, self._stats().peak_allocated - base)

    def empty_cache(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        """Start every peak figure, the running maxima included, from what is held now."""
        torch.cuda.reset_peak_memory_stats(self.device)
        stats = self._stats()
        self._peak_allocated, self._peak_reserved = stats.allocated, stats.reserved

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
        self.workspaces = 0

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

    def allocator_ooms(self) -> int:
        """No caching allocator on the CPU: a failure raises ``OutOfMemoryError`` itself."""
        return 0

    def process_used(self) -> int:
        """Resident memory of this process."""
        return int(psutil.Process().memory_info().rss)

    @property
    def baseline(self) -> int:
        """Bytes that stay allocated between batches: the weights."""
        return self.weights + self.workspaces

    def set_baseline(self) -> None:
        """Nothing stays allocated beyond the weights on the CPU: torch frees every
        temporary, library workspaces included."""

    def in_use(self) -> int:
        return self.tracker.live if self.tracker else 0

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
