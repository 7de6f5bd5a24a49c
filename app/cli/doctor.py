"""`vramguard doctor`: what this computer has, and whether the model can run on it."""

from __future__ import annotations

import time
from pathlib import Path

from app.config import Settings
from app.engine.system_checks import Check, Checks, system_checks
from app.vocabulary import GPU_CACHE, LIMIT, PER_BATCH, PER_IMAGE, ROOM_FOR_IMAGES


def _print(check: Check) -> None:
    print(check.line())


def run_doctor(settings: Settings, config_file: Path) -> int:
    """Print one line per check; exit status 1 when any check found a problem."""
    checks = system_checks(settings, config_file, Checks(echo=_print))
    if checks.stopped:
        print(f"{checks.problems} problem(s) found: the lines marked !! above say why")
        return 1
    from app.engine.engine import InferenceEngine
    from app.engine.residency import needed
    from app.memory.diagnostics import IDLE_PERIOD_S, cache_verdict, leak_check_verdict
    from app.memory.gpu_programs import other_programs
    from app.memory.probes import CpuProbe, CudaProbe
    from app.memory.sharing import gpu_sharing_seen
    from app.models import ModelLoadError
    from app.schemas import programs_line
    from app.units import human_bytes

    line = checks.add
    engine: InferenceEngine | None = None
    try:
        started = time.perf_counter()
        engine = InferenceEngine(settings, sharing=gpu_sharing_seen)
        runtime = engine.warm_up(engine.load())
        elapsed = time.perf_counter() - started
        line("model", f"{runtime.model.name} loaded and warmed up in {elapsed:.2f} s "
             f"({runtime.model.weights_file})")
    except (ModelLoadError, RuntimeError, OSError) as exc:
        line("model", exc, ok=False)
        print(f"{checks.problems} problem(s) found")
        if engine is not None:
            engine.models.sharing.release()
        return 1
    fit = runtime.memory.fit
    line("batch size", f"{engine.batcher.max_batch} "
         f"({runtime.warmup.throughput_at(engine.batcher.max_batch):.1f} images/s at warmup)")
    line(PER_BATCH.name.lower(), f"{human_bytes(fit.fixed_bytes)}, "
         f"{PER_IMAGE.name.lower()} {human_bytes(fit.bytes_per_sample)} (measured at warmup)")
    reading, probe = runtime.probe.read(), runtime.probe
    line(GPU_CACHE.name, cache_verdict(reading.device, reading.allocated, reading.reserved,
                                       reading.inactive_split))
    if isinstance(probe, CudaProbe):
        programs = other_programs(probe.nvml)
        line("other programs on the GPU", programs_line(programs) if programs else
             "none listed" if probe.nvml is not None else "unknown (NVML is not available)")
        sharing = engine.models.sharing
        if sharing.problem is not None:
            line("other vramguards on the GPU", f"cannot be seen: {sharing.problem}", ok=False)
        else:
            line("other vramguards on the GPU", "none" if not sharing.others else
                 ", ".join(f"process {c.pid} on port {c.port}" for c in sharing.others)
                 + f": each plans for {sharing.share:.0%} of its memory")
    line("leak check", leak_check_verdict(not isinstance(probe, CpuProbe) or probe.tracker
                                          is not None, settings.idle_release_s or IDLE_PERIOD_S))
    print(f"   {LIMIT.name.lower()} and {ROOM_FOR_IMAGES.name.lower()}:")
    for text in runtime.guard.budget.lines():
        print(f"     {text}")
    room = runtime.guard.budget.room
    line(LIMIT.name.lower(), f"{human_bytes(room)} for models and images together; "
         f"{runtime.model.name} takes {human_bytes(needed([runtime.footprint]))} with its "
         f"largest batch, leaving {human_bytes(max(0, room - needed([runtime.footprint])))} "
         "for other models (idle ones are unloaded when a request needs the room)")
    entries = engine.sources.catalogue(fresh=True)
    line("models", ", ".join(e.name for e in entries if e.installed))
    for entry in entries:
        if not entry.installed:
            line(f"  {entry.name}", f"cannot load: {entry.note}", ok=False)
    if runtime.guard.budget_bytes < fit.peak(1):
        line(ROOM_FOR_IMAGES.name.lower(), "too small for even one image: close programs "
             "that use the GPU, or raise memory_fraction", ok=False)
    print("all checks passed" if not checks.problems else f"{checks.problems} problem(s) found")
    engine.models.sharing.release()
    return 1 if checks.problems else 0
