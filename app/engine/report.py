"""The memory report: every figure ``/v1/memory`` shows, read on the device thread, and the
last one kept for ``/metrics``, the live samples and the view (none of which may touch the
device).

The rule: the device-wide figures are read through the primary model's probe and guard
(one probe, one budget for all); the counters are summed over the loaded models. A report
exists from the moment a first model is installed, so ``/metrics`` has every memory series
from the first scrape after ``/readyz`` says ready.
"""

from __future__ import annotations

from app.engine.runtime import LoadedModels, Runtime
from app.memory.allocations import LargeAllocationWatch
from app.memory.diagnostics import MemoryDiagnostics
from app.memory.gpu_programs import other_programs
from app.memory.probes import CpuProbe, CudaProbe, MemoryReading
from app.schemas import MemoryReport, ModelMemory, ProfilePoint


class MemoryReports:
    """Builds memory reports and keeps the last one (``last``) and the idle diagnostics."""

    def __init__(self, models: LoadedModels, allocations: LargeAllocationWatch,
                 cpu_instead_of_gpu: str | None) -> None:
        self.models = models
        self.allocations = allocations
        self.cpu_instead_of_gpu = cpu_instead_of_gpu
        self.last: MemoryReport | None = None
        self.diagnostics: MemoryDiagnostics | None = None

    def diagnosed(self, reading: MemoryReading) -> MemoryDiagnostics:
        """The diagnostics, started from the first reading after warmup (the warm level)."""
        if self.diagnostics is None:
            self.diagnostics = MemoryDiagnostics(self.kept(reading))
        return self.diagnostics

    def kept(self, reading: MemoryReading) -> int:
        """What tensors hold beyond the loaded models' weights and the libraries' kept
        workspaces (the probe's baseline): the leak rule's level. Raw allocated bytes
        would rise with every model loaded on demand and look like a leak."""
        probe = self.models.probe
        baseline = probe.baseline if probe is not None else 0
        return max(0, reading.allocated - baseline)

    def _rebase(self) -> None:
        """The loaded models changed, and the baseline with them: the leak watch starts
        again from what is held now."""
        probe = self.models.probe
        if self.diagnostics is not None and probe is not None:
            self.diagnostics.rebase(self.kept(probe.read()))

    def publish(self) -> None:
        """A model was installed: the report again, with it."""
        self._rebase()
        primary = self.models.primary
        if primary is not None and primary.model is not None:
            self.last = self.report(primary)

    def after_unload(self) -> None:
        """A model was unloaded: the report again; with nothing loaded, the last figures
        without models."""
        self._rebase()
        primary = self.models.primary
        if primary is not None:
            self.last = self.report(primary)
        elif self.last is not None:
            self.last = self.last.model_copy(update={"models": [], "weights_bytes": 0})

    def report(self, runtime: Runtime) -> MemoryReport:
        probe, guard, memory = runtime.probe, runtime.guard, runtime.memory
        reading = probe.read()
        named = list(self.models.runtimes.items())
        runtimes = [r for _, r in named]
        counters = [r.guard.counters for r in runtimes]
        diagnostics = self.diagnosed(reading)
        nvml = probe.nvml if isinstance(probe, CudaProbe) else None
        return MemoryReport(
            device=reading.device,
            source=reading.source,
            nvml=reading.source == "nvml",
            total_bytes=reading.total,
            used_bytes=reading.used,
            free_bytes=reading.free,
            allocated_bytes=reading.allocated,
            reserved_bytes=reading.reserved,
            peak_allocated_bytes=reading.peak_allocated,
            peak_reserved_bytes=reading.peak_reserved,
            others_bytes=reading.others,
            other_programs=other_programs(nvml),
            weights_bytes=sum(r.memory.weights_bytes for r in runtimes),
            overhead_bytes=memory.overhead_bytes,
            configured_budget_bytes=guard.configured_bytes,
            budget_bytes=guard.budget_bytes,
            low_watermark_bytes=guard.low_bytes,
            high_watermark_bytes=guard.high_bytes,
            usage_bytes=guard.usage,
            state=guard.state,
            fixed_bytes=guard.fit.fixed_bytes,
            bytes_per_sample=guard.fit.bytes_per_sample,
            profiled_bytes_per_sample=guard.profiled.bytes_per_sample,
            profile_points=[ProfilePoint(batch_size=b, peak_bytes=p) for b, p in memory.points],
            max_batch_now=guard.max_batch_now(probe.in_use()),
            cpu_memory_cap_bytes=probe.cap if isinstance(probe, CpuProbe) else None,
            process_used_bytes=probe.process_used(),
            oom_events=sum(c.oom_events for c in counters),
            oom_recoveries=sum(c.oom_recoveries for c in counters),
            oom_failures=sum(c.oom_failures for c in counters),
            state_changes=sum(c.state_changes for c in counters),
            idle_releases=sum(c.idle_releases for c in counters),
            cache_empties=sum(c.cache_empties for c in counters),
            fragmentation_releases=diagnostics.fragmentation_releases,
            leak_suspected=diagnostics.leak_suspected,
            leak_growth_bytes=diagnostics.leak_growth,
            idle_baselines_bytes=list(diagnostics.baselines),
            large_allocations=self.allocations.logged,
            gpu_utilization_ratio=nvml.utilization() if nvml is not None else None,
            cpu_instead_of_gpu=self.cpu_instead_of_gpu,
            sharing_with=self.models.sharing.listed(),
            sharing_problem=self.models.sharing.problem,
            models=[self.model_memory(n, r) for n, r in named],
        )

    def model_memory(self, name: str, runtime: Runtime) -> ModelMemory:
        """One model's share, and what it is (so the tray and the dashboard can say it
        without asking /v1/models); the schema's defaults for a runtime installed for its
        memory figures alone, without a model."""
        model = runtime.model
        kind = {} if model is None else {"task": model.task, "format": model.family,
                                          "labels": len(model.labels), "own": model.own}
        return ModelMemory(name=name, weights_bytes=runtime.memory.weights_bytes,
                           batch_peak_bytes=runtime.footprint.batch_peak,
                           batch_size=runtime.guard.max_batch,
                           pinned=self.models.pinned(name), **kind)
