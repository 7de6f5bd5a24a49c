"""A scripted stand-in for ``torch.cuda``'s memory API and for ``pynvml``, for tests only.

This project has no GPU in CI, and the CUDA-only paths (per-batch peak reset,
OOM classification, the NVML fallbacks, fragmentation) cannot run on the CPU
analogue. This module reproduces the documented semantics those paths rely on,
so their logic can be tested honestly. It is never imported from ``app/``:
tests install it with pytest's ``monkeypatch``.

Semantics kept (PyTorch "CUDA semantics / memory management" and the NVML docs):

- allocated <= reserved <= the device; allocations are rounded up to 512 bytes
  and carved from 2 MiB-rounded *segments*; a freed block goes back to its
  segment (cached: still reserved), and a new allocation reuses a free segment
  large enough for it (best fit), else the allocator reserves a new one; blocks below
  1 MiB share 2 MiB segments of their own (the small pool: first fit);
- before failing, the allocator frees every unused cached segment and retries
  (``num_alloc_retries``); then it raises ``torch.OutOfMemoryError`` with
  CUDA's message (``num_ooms``). Reserved is capped by the device and by
  ``set_per_process_memory_fraction(f)`` (``f x total``);
- ``max_memory_allocated`` / ``max_memory_reserved`` are maxima since the last
  ``reset_peak_memory_stats``, which sets them to the current figures;
- ``empty_cache`` returns unused segments to the device; used ones stay;
- ``mem_get_info`` = (free, total), where the device's used memory is the CUDA
  context + this process's reserved + other programs;
- NVML sees the whole device: total, used (v1 counts the driver's reserved
  memory as used; v2 reports it apart), per-process use by *host* PID (None
  under WDDM), utilisation, MIG mode and driver model; every call can fail with
  an ``NVMLError``.

API
---

``cuda = CudaStandIn(total=24 GiB, context=300 MiB, others=0)`` then
``cuda.install(monkeypatch)`` patches ``torch.cuda``: ``is_available``,
``device_count``, ``current_device``, ``memory_allocated``, ``memory_reserved``,
``max_memory_allocated``, ``max_memory_reserved``, ``reset_peak_memory_stats``,
``mem_get_info``, ``empty_cache``, ``memory_stats`` (and its nested form),
``get_device_properties``
(``.total_memory``, ``.name``, PCI ids), ``synchronize``,
``set_per_process_memory_fraction``, and ``torch.cuda.memory._record_memory_history``,
``_snapshot`` and ``_dump_snapshot``. Every function accepts (and ignores) a
device argument. Scripting:

- ``cuda.alloc(nbytes) -> handle`` and ``cuda.free(handle)``: a tensor's life;
- ``cuda.forward(*sizes)``: a forward pass: allocates every size, then frees
  them all (the peak stays, the cache keeps the segments);
- ``cuda.fail_next_alloc(exc=None, times=1)``: the next allocation(s) raise
  ``exc`` (an exception instance; by default CUDA's ``torch.OutOfMemoryError``);
  use it for ``torch.AcceleratorError`` or cuDNN / cuBLAS ``RuntimeError``\\ s;
- ``cuda.others = n``: other programs now use n bytes of the device;
- read-only figures: ``allocated``, ``reserved``, ``peak_allocated``,
  ``peak_reserved``, ``used`` (device-wide), ``limit`` (the reserved cap),
  ``segments`` (list of ``Segment(size, used)``), ``history`` (the kwargs of
  every ``_record_memory_history`` call), ``calls`` (a ``Counter`` of calls by name).

``nvml = NvmlStandIn(cuda)`` then ``nvml.install(monkeypatch)`` puts it into
``sys.modules["pynvml"]`` (``import pynvml`` then finds it). Knobs, all
settable after creation:

- ``total`` (default: CUDA's total; set it apart to script a disagreement),
  ``driver_reserved`` (bytes v1 counts as used and v2 reports as reserved),
  ``driver_version``;
- ``pid`` (the PID NVML reports for this process; default ``os.getpid()``, set
  another to script a container's host PID), ``process_used`` (None = WDDM:
  not reported), ``other_processes`` (``{pid: bytes}``);
- ``mig`` (bool; under MIG the lookup by bus id returns the parent GPU, so set
  ``total`` to the parent's too), ``driver_model`` (``NVML_DRIVER_WDDM``, ``NVML_DRIVER_WDM``
  (TCC), ``NVML_DRIVER_MCDM``, or None: NOT_SUPPORTED, as on Linux),
  ``utilization`` (``(gpu %, memory %)``);
- ``nvml.fail(name, code=NVML_ERROR_UNKNOWN, times=None)``: calls to the
  function ``name`` (e.g. ``"nvmlDeviceGetMemoryInfo"``, ``"nvmlInit"``) raise
  ``NVMLError(code)``; ``times=None`` means every call from now on.

Module functions: ``nvmlInit``, ``nvmlShutdown``, ``nvmlSystemGetDriverVersion``,
``nvmlDeviceGetCount``, ``nvmlDeviceGetHandleByIndex``,
``nvmlDeviceGetHandleByPciBusId``, ``nvmlDeviceGetName``,
``nvmlDeviceGetMemoryInfo(handle, version=None)`` (``version=nvmlMemory_v2``
gives ``.reserved``), ``nvmlDeviceGetComputeRunningProcesses``,
``nvmlDeviceGetGraphicsRunningProcesses`` (``graphics_processes``: ``{pid: bytes or
None}``), ``nvmlDeviceGetUtilizationRates`` (``.gpu``, ``.memory``),
``nvmlDeviceGetMigMode`` (``[current, pending]``), ``nvmlDeviceGetDriverModel``
(``[current, pending]``), ``nvmlDeviceIsMigDeviceHandle``; plus ``NVMLError``
and the ``NVML_*`` constants the app uses. ``install_gpu(monkeypatch, **cuda_kwargs)``
installs both and returns ``(cuda, nvml)``.
"""

from __future__ import annotations

import os
import pickle
import sys
import types
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

KiB, MiB, GiB = 1024, 1024**2, 1024**3
BLOCK = 512
SEGMENT = 2 * MiB
SMALL = MiB  # blocks below this share 2 MiB segments (the small pool)


def round_up(n: int, unit: int) -> int:
    return max(unit, -(-n // unit) * unit)


@dataclass
class Segment:
    """One cudaMalloc'd segment; ``used`` is the block carved from it (0 = cached, free)."""

    size: int
    used: int = 0
    small: bool = False  # of the small pool: holds several blocks below SMALL bytes


class CudaStandIn:
    """One CUDA device and its caching allocator, as ``torch.cuda`` reports them."""

    def __init__(self, total: int = 24 * GiB, context: int = 300 * MiB, others: int = 0,
                 name: str = "Stand-in GPU") -> None:
        self.total = total
        self.context = context
        self.others = others
        self.name = name
        self.limit = total
        self.segments: list[Segment] = []
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.history: list[dict[str, Any]] = []
        self.recording = False
        self.calls: Counter[str] = Counter()
        self.stats: Counter[str] = Counter()
        self._handles: dict[int, tuple[Segment, int]] = {}
        self._next_handle = 1
        self._failures: list[BaseException] = []

    # -- figures ------------------------------------------------------------------------

    @property
    def allocated(self) -> int:
        return sum(s.used for s in self.segments)

    @property
    def reserved(self) -> int:
        return sum(s.size for s in self.segments)

    @property
    def used(self) -> int:
        """Device-wide use: context, this process's segments and other programs."""
        return self.context + self.reserved + self.others

    # -- scripting ----------------------------------------------------------------------

    def alloc(self, nbytes: int) -> int:
        """Allocate like the caching allocator; a handle for ``free``."""
        self.calls["alloc"] += 1
        if self._failures:
            raise self._failures.pop(0)
        size = round_up(nbytes, BLOCK)
        if size < SMALL:
            segment = next((s for s in self.segments if s.small and s.size - s.used >= size),
                           None) or self._reserve(SEGMENT, small=True)
        else:
            segment = self._reuse(size) or self._reserve(size)
        segment.used += size
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        self._handles[handle] = (segment, size)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return handle

    def free(self, handle: int) -> None:
        """The tensor died: its block goes back to the cache, still reserved."""
        segment, size = self._handles.pop(handle)
        segment.used -= size

    def forward(self, *sizes: int) -> None:
        """A forward pass: every activation allocated, then all freed (also when an
        allocation fails: the activations die with the exception's frames)."""
        handles: list[int] = []
        try:
            for size in sizes:
                handles.append(self.alloc(size))
        finally:
            for handle in handles:
                self.free(handle)

    def fail_next_alloc(self, exc: BaseException | None = None, times: int = 1) -> None:
        """The next ``times`` allocations raise ``exc`` (default: CUDA's OOM)."""
        for _ in range(times):
            self._failures.append(exc or torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 MiB (stand-in)"))

    def _reuse(self, size: int) -> Segment | None:
        free = [s for s in self.segments if not s.small and not s.used and s.size >= size]
        return min(free, key=lambda s: s.size) if free else None

    def _reserve(self, size: int, small: bool = False) -> Segment:
        seg = round_up(size, SEGMENT)
        if not self._fits(seg):
            self.stats["num_alloc_retries"] += 1
            self.empty_cache()
            if not self._fits(seg):
                self.stats["num_ooms"] += 1
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {seg / MiB:.2f} MiB. GPU 0 has a "
                    f"total capacity of {self.total / GiB:.2f} GiB of which "
                    f"{self.mem_get_info()[0] / MiB:.2f} MiB is free (stand-in)")
        segment = Segment(seg, small=small)
        self.segments.append(segment)
        self.stats["num_device_alloc"] += 1
        return segment

    def _fits(self, seg: int) -> bool:
        return self.reserved + seg <= self.limit and self.used + seg <= self.total

    # -- the torch.cuda API -------------------------------------------------------------

    def memory_allocated(self, device: Any = None) -> int:
        self.calls["memory_allocated"] += 1
        return self.allocated

    def memory_reserved(self, device: Any = None) -> int:
        self.calls["memory_reserved"] += 1
        return self.reserved

    def max_memory_allocated(self, device: Any = None) -> int:
        self.calls["max_memory_allocated"] += 1
        return self.peak_allocated

    def max_memory_reserved(self, device: Any = None) -> int:
        self.calls["max_memory_reserved"] += 1
        return self.peak_reserved

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.calls["reset_peak_memory_stats"] += 1
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        self.calls["mem_get_info"] += 1
        return max(0, self.total - self.used), self.total

    def empty_cache(self) -> None:
        self.calls["empty_cache"] += 1
        kept = [s for s in self.segments if s.used]
        self.stats["num_device_free"] += len(self.segments) - len(kept)
        self.segments = kept

    def memory_stats(self, device: Any = None) -> dict[str, Any]:
        self.calls["memory_stats"] += 1
        allocated = self.allocated
        return {
            "allocated_bytes.all.current": allocated,
            "allocated_bytes.all.peak": self.peak_allocated,
            "active_bytes.all.current": allocated,
            "reserved_bytes.all.current": self.reserved,
            "reserved_bytes.all.peak": self.peak_reserved,
            "inactive_split_bytes.all.current": sum(s.size - s.used for s in self.segments
                                                    if s.used),
            "segment.all.current": len(self.segments),
            "allocation.all.current": len(self._handles),
            "num_alloc_retries": self.stats["num_alloc_retries"],
            "num_ooms": self.stats["num_ooms"],
            "num_device_alloc": self.stats["num_device_alloc"],
            "num_device_free": self.stats["num_device_free"],
        }

    def memory_stats_as_nested_dict(self, device: Any = None) -> dict[str, Any]:
        """The allocator's own nested form of ``memory_stats`` (the counters the app reads)."""
        self.calls["memory_stats_as_nested_dict"] += 1
        flat = self.memory_stats()
        self.calls["memory_stats"] -= 1
        nested: dict[str, Any] = {}
        for key, value in flat.items():
            parts = key.split(".")
            level = nested
            for part in parts[:-1]:
                level = level.setdefault(part, {})
            level[parts[-1]] = value
        return nested

    def get_device_properties(self, device: Any = None) -> types.SimpleNamespace:
        self.calls["get_device_properties"] += 1
        return types.SimpleNamespace(name=self.name, total_memory=self.total, major=9, minor=0,
                                     multi_processor_count=132, pci_domain_id=0,
                                     pci_bus_id=0x41, pci_device_id=0)

    def synchronize(self, device: Any = None) -> None:
        self.calls["synchronize"] += 1

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        if not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.calls["set_per_process_memory_fraction"] += 1
        self.limit = int(fraction * self.total)

    def record_memory_history(self, enabled: str | None = "all", context: str | None = "all",
                              stacks: str = "all", max_entries: int = sys.maxsize,
                              device: Any = None, **kwargs: Any) -> None:
        if stacks not in ("python", "all"):
            raise ValueError(f"stacks must be 'python' or 'all', not {stacks!r}")
        self.history.append({"enabled": enabled, "context": context, "stacks": stacks,
                             "max_entries": max_entries, **kwargs})
        self.recording = enabled is not None

    def snapshot(self, device: Any = None, **kwargs: Any) -> dict[str, Any]:
        self.calls["snapshot"] += 1
        return {"segments": [{"total_size": s.size, "allocated_size": s.used}
                             for s in self.segments],
                "device_traces": [[]] if self.recording else []}

    def dump_snapshot(self, filename: str = "dump_snapshot.pickle") -> None:
        with open(filename, "wb") as file:
            pickle.dump(self.snapshot(), file)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> CudaStandIn:
        """Patch ``torch.cuda`` (and ``torch.cuda.memory``'s history functions) for one test."""
        for name in ("memory_allocated", "memory_reserved", "max_memory_allocated",
                     "max_memory_reserved", "reset_peak_memory_stats", "mem_get_info",
                     "empty_cache", "memory_stats", "memory_stats_as_nested_dict",
                     "get_device_properties", "synchronize",
                     "set_per_process_memory_fraction"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                            self.record_memory_history)
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", self.snapshot)
        monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", self.dump_snapshot)
        return self


# -- pynvml ---------------------------------------------------------------------------

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999
NVML_DRIVER_WDDM, NVML_DRIVER_WDM, NVML_DRIVER_MCDM = 0, 1, 2
NVML_DEVICE_MIG_DISABLE, NVML_DEVICE_MIG_ENABLE = 0, 1
nvmlMemory_v2 = 0x02000028

_ERROR_TEXT = {NVML_ERROR_UNINITIALIZED: "Uninitialized", NVML_ERROR_NOT_SUPPORTED:
               "Not Supported", NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
               NVML_ERROR_NOT_FOUND: "Not Found", NVML_ERROR_DRIVER_NOT_LOADED:
               "Driver Not Loaded", NVML_ERROR_GPU_IS_LOST: "GPU is lost",
               NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
               NVML_ERROR_UNKNOWN: "Unknown Error"}


class NVMLError(Exception):
    """pynvml's error: ``value`` is the NVML return code."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _ERROR_TEXT.get(self.value, f"NVML Error with code {self.value}")


class NvmlStandIn:
    """The ``pynvml`` module for one GPU whose memory is ``cuda``'s."""

    def __init__(self, cuda: CudaStandIn) -> None:
        self.cuda = cuda
        self.total: int = cuda.total
        self.driver_reserved = 0
        self.driver_version = "595.20"
        self.pid = os.getpid()
        self.process_used: int | type[_Auto] | None = _Auto
        self.other_processes: dict[int, int | None] = {}  # compute: CUDA programs
        self.graphics_processes: dict[int, int | None] = {}  # games, browsers, the desktop
        self.mig = False
        self.driver_model: int | None = None
        self.utilization = (0, 0)
        self.initialized = False
        self.inits = 0
        self.calls: Counter[str] = Counter()
        self._failures: dict[str, int | None] = {}
        self._codes: dict[str, int] = {}
        self.module = self._module()

    def fail(self, name: str, code: int = NVML_ERROR_UNKNOWN, times: int | None = None) -> None:
        """Calls to ``name`` raise ``NVMLError(code)``: ``times`` of them, or all (None)."""
        self._failures[name] = times
        self._codes[name] = code

    def install(self, monkeypatch: pytest.MonkeyPatch) -> NvmlStandIn:
        monkeypatch.setitem(sys.modules, "pynvml", self.module)
        return self

    # -- the module ---------------------------------------------------------------------

    def _call(self, name: str) -> None:
        self.calls[name] += 1
        if name in self._failures:
            left = self._failures[name]
            if left is None or left > 0:
                if left is not None:
                    self._failures[name] = left - 1
                raise NVMLError(self._codes[name])
        if name not in ("nvmlInit", "nvmlShutdown") and not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def _own_use(self) -> int:
        return self.cuda.context + self.cuda.reserved

    def _module(self) -> types.ModuleType:
        module = types.ModuleType("pynvml", "stand-in (tests/support/cuda_standin.py)")
        module.__file__ = __file__  # where a report says the module came from
        handle = object()

        def wrap(name: str, fn: Any) -> None:
            def call(*args: Any, **kwargs: Any) -> Any:
                self._call(name)
                return fn(*args, **kwargs)
            call.__name__ = name
            setattr(module, name, call)

        # NVML counts its initializations: it shuts down at the last nvmlShutdown.
        def init() -> None:
            self.inits += 1
            self.initialized = True

        def shutdown() -> None:
            self.inits = max(0, self.inits - 1)
            self.initialized = self.inits > 0

        def memory_info(h: Any, version: int | None = None) -> types.SimpleNamespace:
            used = (self._own_use() + self.cuda.others
                    + sum(n or 0 for n in self.other_processes.values())
                    + sum(n or 0 for n in self.graphics_processes.values()))
            if version:
                return types.SimpleNamespace(version=version, total=self.total,
                                             reserved=self.driver_reserved, used=used,
                                             free=max(0, self.total - used
                                                      - self.driver_reserved))
            used += self.driver_reserved
            return types.SimpleNamespace(total=self.total, used=used,
                                         free=max(0, self.total - used))

        def processes(h: Any) -> list[types.SimpleNamespace]:
            own = self._own_use() if self.process_used is _Auto else self.process_used
            rows = [types.SimpleNamespace(pid=self.pid, usedGpuMemory=own, gpuInstanceId=0,
                                          computeInstanceId=0)]
            rows += [types.SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=0,
                                           computeInstanceId=0)
                     for pid, used in self.other_processes.items()]
            return rows

        def graphics(h: Any) -> list[types.SimpleNamespace]:
            return [types.SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=0,
                                          computeInstanceId=0)
                    for pid, used in self.graphics_processes.items()]

        def driver_model(h: Any) -> list[int]:
            if self.driver_model is None:
                raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
            return [self.driver_model, self.driver_model]

        def by_index(index: int) -> object:
            if index != 0:
                raise NVMLError(NVML_ERROR_NOT_FOUND)
            return handle

        wrap("nvmlInit", init)
        wrap("nvmlShutdown", shutdown)
        wrap("nvmlSystemGetDriverVersion", lambda: self.driver_version)
        wrap("nvmlDeviceGetCount", lambda: 1)
        wrap("nvmlDeviceGetHandleByIndex", by_index)
        wrap("nvmlDeviceGetHandleByPciBusId", lambda bus: handle)
        wrap("nvmlDeviceGetName", lambda h: self.cuda.name)
        wrap("nvmlDeviceGetMemoryInfo", memory_info)
        wrap("nvmlDeviceGetComputeRunningProcesses", processes)
        wrap("nvmlDeviceGetGraphicsRunningProcesses", graphics)
        wrap("nvmlDeviceGetUtilizationRates", lambda h: types.SimpleNamespace(
            gpu=self.utilization[0], memory=self.utilization[1]))
        wrap("nvmlDeviceGetMigMode", lambda h: [int(self.mig)] * 2)
        # nvidia-ml-py's nvmlDeviceGetDriverModel calls the _v2 symbol; fail("..._v2",
        # NVML_ERROR_FUNCTION_NOT_FOUND) plays a driver older than the library.
        wrap("nvmlDeviceGetDriverModel_v2", driver_model)
        wrap("nvmlDeviceGetDriverModel_v1", driver_model)
        module.nvmlDeviceGetDriverModel = module.nvmlDeviceGetDriverModel_v2
        wrap("nvmlDeviceIsMigDeviceHandle", lambda h: False)
        for name, value in globals().items():
            if name.startswith("NVML_") or name in ("NVMLError", "nvmlMemory_v2"):
                setattr(module, name, value)
        return module


class _Auto:
    """``process_used`` default: this process's real use (context + reserved)."""


def install_gpu(monkeypatch: pytest.MonkeyPatch,
                **cuda_kwargs: Any) -> tuple[CudaStandIn, NvmlStandIn]:
    """Both stand-ins, installed: the usual start of a test of a CUDA path."""
    cuda = CudaStandIn(**cuda_kwargs).install(monkeypatch)
    return cuda, NvmlStandIn(cuda).install(monkeypatch)


class StandInForward:
    """A forward pass on the stand-in: one activation of ``per_image`` bytes per image,
    all alive at once, all freed on return (what the caching allocator sees)."""

    def __init__(self, cuda: CudaStandIn, per_image: int) -> None:
        self.cuda = cuda
        self.per_image = per_image

    def __call__(self, samples: list[Any]) -> list[Any]:
        from app.engine.predictor import Prediction, Ranked

        self.cuda.forward(*[self.per_image] * len(samples))
        ranked = Ranked(np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.float32))
        return [Prediction(ranked, len(samples)) for _ in samples]
